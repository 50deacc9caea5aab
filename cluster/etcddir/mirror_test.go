package etcddir

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
)

// sameEntry reports whether the mirror's answer is the directory's.
func sameEntry(a, b Entry) bool {
	return a.ID == b.ID && a.Revision == b.Revision && a.Size == b.Size && slices.Equal(a.Sums, b.Sums) &&
		slices.Equal(a.Holders, b.Holders) && a.Owner == b.Owner && a.Shared == b.Shared
}

// watchIDs polls m's answer for ref in the background and records every
// incarnation id it served, in order, until stop; last is the latest.
func watchIDs(m *Mirror, ref cluster.Ref) (stop func() []string, last func() string) {
	var mu sync.Mutex
	var ids []string
	var done atomic.Bool
	var wg sync.WaitGroup
	wg.Go(func() {
		for !done.Load() {
			if e, ok := m.Lookup(ref); ok {
				mu.Lock()
				if len(ids) == 0 || ids[len(ids)-1] != e.ID {
					ids = append(ids, e.ID)
				}
				mu.Unlock()
			}
			time.Sleep(200 * time.Microsecond)
		}
	})
	return func() []string {
			done.Store(true)
			wg.Wait()
			return ids
		}, func() string {
			mu.Lock()
			defer mu.Unlock()
			if len(ids) == 0 {
				return ""
			}
			return ids[len(ids)-1]
		}
}

// loadedMirror starts a mirror of d, closed when the test ends, and waits
// (10 s at most) until it has loaded the records.
func loadedMirror(t *testing.T, ctx context.Context, d *Directory) *Mirror {
	t.Helper()
	m := d.Mirror(ctx)
	t.Cleanup(func() { m.Close() })
	eventually(t, 10*time.Second, "the mirror loads", m.Synced)
	return m
}

// publishMirrored publishes o through d and waits until m answers for it.
func publishMirrored(t *testing.T, ctx context.Context, d *Directory, m *Mirror, o cluster.Object) {
	t.Helper()
	mustPublish(t, ctx, d, o)
	waitMirror(t, m, o.Ref(), true, "the mirror has "+o.Name)
}

// waitMirror waits (10 s at most) until whether m answers for ref is
// answers.
func waitMirror(t *testing.T, m *Mirror, ref cluster.Ref, answers bool, what string) {
	t.Helper()
	eventually(t, 10*time.Second, what, func() bool { _, ok := m.Lookup(ref); return ok == answers })
}

func TestMirrorFollowsCreateReplaceDelete(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b, c := open(t, srv, "a"), open(t, srv, "b"), open(t, srv, "c")
	ctx := ctxT(t)
	// A record made before the mirror starts comes with its load.
	before, _ := object("before", 4096)
	mustPublish(t, ctx, a, before)
	m := loadedMirror(t, ctx, c)
	if e, ok := m.Lookup(before.Ref()); !ok || e.ID != before.ID || !slices.Equal(e.Holders, []string{"a"}) {
		t.Fatalf("record made before the mirror: %+v %v", e, ok)
	}

	o, _ := object("model/w 1", 64<<10+3)
	ref := o.Ref()
	if _, ok := m.Lookup(ref); ok {
		t.Fatal("the mirror answers for a name not recorded")
	}
	ids, lastID := watchIDs(m, ref)
	mustPublish(t, ctx, a, o)
	var e Entry
	eventually(t, 10*time.Second, "the mirror has the new record", func() bool {
		var ok bool
		e, ok = m.Lookup(ref)
		return ok
	})
	want, err := c.Lookup(ctx, ref)
	if err != nil || !sameEntry(e, want) || e.Origin != "a" {
		t.Fatalf("mirror %+v, directory %+v %v", e, want, err)
	}
	// A second holder.
	if err := b.AddHolder(ctx, e); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the mirror has both holders", func() bool {
		e, _ := m.Lookup(ref)
		return slices.Equal(e.Holders, []string{"a", "b"})
	})
	// Holders leave: no live holder, no answer (the caller asks etcd).
	if err := a.RemoveHolder(ctx, ref); err != nil {
		t.Fatal(err)
	}
	if err := b.RemoveHolder(ctx, ref); err != nil {
		t.Fatal(err)
	}
	waitMirror(t, m, ref, false, "the mirror drops a record nobody holds")
	// Replaced by a new incarnation.
	o2 := o
	o2.ID = cluster.NewID()
	mustPublish(t, ctx, b, o2)
	eventually(t, 10*time.Second, "the mirror has the new incarnation", func() bool {
		e, ok := m.Lookup(ref)
		return ok && e.ID == o2.ID && slices.Equal(e.Holders, []string{"b"})
	})
	// Deleted, then created again by another node: once the mirror shows
	// the third incarnation it never shows an older one.
	if err := a.Delete(ctx, o.Owner, o.Name); err != nil {
		t.Fatal(err)
	}
	waitMirror(t, m, ref, false, "the mirror drops the deleted name")
	o3 := o
	o3.ID = cluster.NewID()
	mustPublish(t, ctx, a, o3)
	eventually(t, 10*time.Second, "the mirror has the re-created name", func() bool {
		e, ok := m.Lookup(ref)
		return ok && e.ID == o3.ID
	})
	// The poller sees it too (a sleep here was too short under -race on
	// a loaded machine).
	eventually(t, 10*time.Second, "the poller sees the re-created name", func() bool { return lastID() == o3.ID })
	// The poller may miss a short-lived incarnation, never see one out
	// of order.
	got, order := ids(), []string{o.ID, o2.ID, o3.ID}
	last := -1
	for _, id := range got {
		i := slices.Index(order, id)
		if i <= last {
			t.Fatalf("incarnations the mirror served, in order: %v; created: %v", got, order)
		}
		last = i
	}
	if last != 2 {
		t.Fatalf("the mirror's last answer was not the newest incarnation: %v", got)
	}

	// Versions: the latest record is mirrored, and each shard's record.
	v := o
	v.Name, v.Version, v.Shards, v.ID = "versioned", 3, 1, cluster.NewID()
	mustPublish(t, ctx, a, v)
	eventually(t, 10*time.Second, "the mirror has the version", func() bool {
		l, ok := m.Latest(v.Owner, v.Name)
		e, ok2 := m.Lookup(v.Ref())
		return ok && l.Version == 3 && ok2 && e.ID == v.ID
	})
	if err := a.Delete(ctx, v.Owner, v.Name); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the mirror drops the deleted version", func() bool {
		_, ok := m.Latest(v.Owner, v.Name)
		_, ok2 := m.Lookup(v.Ref())
		return !ok && !ok2
	})
	if hits, misses := m.Stats(); hits == 0 || misses == 0 {
		t.Fatalf("stats: %d hits, %d misses", hits, misses)
	}
}

// A forged record under a mirrored key is never served.
func TestMirrorIgnoresForgedRecords(t *testing.T) {
	srv := etcdtest.Start(t)
	a, c := open(t, srv, "a"), open(t, srv, "c")
	ctx := ctxT(t)
	m := loadedMirror(t, ctx, c)
	o, _ := object("forged", 4096)
	publishMirrored(t, ctx, a, m, o)
	// Someone with etcd access but not the secret replaces the record: the
	// mirror never serves it, and the holder writes the genuine one back.
	evil := o
	evil.Size, evil.ID = 1<<20, cluster.NewID()
	val, _ := cluster.Seal(mustSecret("another-secret-entirely!"), a.k.obj(o.Ref()), &evil)
	if _, err := a.cli.Put(ctx, a.k.obj(o.Ref()), string(val)); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the holder writes the genuine record back", func() bool {
		e, ok := m.Lookup(o.Ref())
		if ok && e.ID != o.ID {
			t.Fatalf("the mirror served the forged record: %+v", e)
		}
		return ok && a.Rewrites() > 0
	})
	// A forged record under a name nobody holds stays unserved.
	x := evil
	x.Name = "forged-only"
	xval, _ := cluster.Seal(mustSecret("another-secret-entirely!"), a.k.obj(x.Ref()), &x)
	hval, _ := cluster.Seal(mustSecret("another-secret-entirely!"), a.k.hold(x.Ref(), "a"), &cluster.Holder{Node: "a", ID: x.ID})
	if _, err := a.cli.Txn(ctx).Then(clientv3.OpPut(a.k.obj(x.Ref()), string(xval)), clientv3.OpPut(a.k.hold(x.Ref(), "a"), string(hval))).Commit(); err != nil {
		t.Fatal(err)
	}
	p, _ := object("after", 1000)
	publishMirrored(t, ctx, a, m, p)
	if e, ok := m.Lookup(x.Ref()); ok {
		t.Fatalf("the mirror served a forged record: %+v", e)
	}
}

// A mirror cut off from etcd answers nothing; when it comes back it loads
// the records again, so changes made meanwhile (even compacted away) are
// never missed.
func TestMirrorResyncsAfterBreak(t *testing.T) {
	srv := etcdtest.Start(t)
	a, c := open(t, srv, "a"), open(t, srv, "c")
	ctx := ctxT(t)
	m := loadedMirror(t, ctx, c)
	x, _ := object("x", 4096)
	publishMirrored(t, ctx, a, m, x)
	loads := m.Loads()

	resume := m.hold()
	if _, ok := m.Lookup(x.Ref()); ok {
		t.Fatal("a mirror cut off from etcd still answers")
	}
	if err := a.Delete(ctx, x.Owner, x.Name); err != nil {
		t.Fatal(err)
	}
	x2 := x
	x2.ID = cluster.NewID()
	mustPublish(t, ctx, a, x2)
	y, _ := object("y", 8192)
	mustPublish(t, ctx, a, y)
	r, err := a.cli.Get(ctx, "compact")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.cli.Compact(ctx, r.Header.Revision); err != nil {
		t.Fatal(err)
	}
	resume()
	eventually(t, 10*time.Second, "the mirror is back with the new records", func() bool {
		e, ok := m.Lookup(x.Ref())
		_, oky := m.Lookup(y.Ref())
		return ok && e.ID == x2.ID && oky
	})
	if m.Loads() <= loads {
		t.Fatalf("the mirror came back without loading the records again (%d loads)", m.Loads())
	}
}

// etcd killed: the mirror stops answering (the node's gets fail fast, as
// without it); restarted: it loads again and follows new changes.
func TestMirrorEtcdRestart(t *testing.T) {
	srv := etcdtest.Start(t)
	a, c := open(t, srv, "a"), open(t, srv, "c")
	ctx := ctxT(t)
	m := loadedMirror(t, ctx, c)
	x, _ := object("x", 4096)
	publishMirrored(t, ctx, a, m, x)
	loads := m.Loads()
	srv.Kill()
	waitMirror(t, m, x.Ref(), false, "the mirror stops answering with etcd down")
	srv.Restart()
	eventually(t, 30*time.Second, "the mirror answers again", func() bool {
		e, ok := m.Lookup(x.Ref())
		return ok && e.ID == x.ID
	})
	if m.Loads() <= loads {
		t.Fatalf("the mirror came back without loading the records again (%d loads)", m.Loads())
	}
	if err := a.Delete(ctx, x.Owner, x.Name); err != nil {
		t.Fatal(err)
	}
	waitMirror(t, m, x.Ref(), false, "the mirror follows a delete after the restart")
}

// A record over MirrorMaxRecord is left to etcd: the mirror does not
// answer for it, and drops an older small incarnation it replaced.
func TestMirrorLeavesLargeRecordsToEtcd(t *testing.T) {
	srv := etcdtest.Start(t)
	a, c := open(t, srv, "a"), open(t, srv, "c")
	ctx := ctxT(t)
	m := loadedMirror(t, ctx, c)
	o, _ := object("big-manifest", 4096)
	publishMirrored(t, ctx, a, m, o)
	if err := a.Delete(ctx, o.Owner, o.Name); err != nil {
		t.Fatal(err)
	}
	big := o
	big.ID, big.Manifest = cluster.NewID(), make([]byte, MirrorMaxRecord)
	mustPublish(t, ctx, a, big)
	other, _ := object("after", 4096)
	publishMirrored(t, ctx, a, m, other)
	if e, ok := m.Lookup(o.Ref()); ok {
		t.Fatalf("the mirror answers for a large record (incarnation %s)", e.ID)
	}
	if e, err := c.Lookup(ctx, o.Ref()); err != nil || e.ID != big.ID {
		t.Fatalf("etcd's answer: %+v %v", e.ID, err)
	}
}

// closedWithin reports whether ch is closed within d.
func closedWithin(ch <-chan struct{}, d time.Duration) bool {
	select {
	case <-ch:
		return true
	default:
	}
	select {
	case <-ch:
		return true
	case <-time.After(d):
		return false
	}
}

// Changed's channel for a name closes at a record of that name written by
// any node (its object, a holder, its latest version) and at the mirror's
// return to sync after etcd was away; not at another name's records.
// Waiters of one name share one channel, forgotten with the last done.
func TestMirrorChanged(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b, c := open(t, srv, "a"), open(t, srv, "b"), open(t, srv, "c")
	ctx := ctxT(t)
	m := loadedMirror(t, ctx, c)

	w1, done1 := m.Changed(1000, "w")
	w2, done2 := m.Changed(1000, "w")
	other, doneOther := m.Changed(1000, "other")
	if w1 != w2 {
		t.Fatal("two waiters of one name got two channels")
	}
	o, _ := object("w", 5000)
	mustPublish(t, ctx, a, o)
	if !closedWithin(w1, 10*time.Second) {
		t.Fatal("a publish of the name did not wake its waiters")
	}
	if closedWithin(other, 100*time.Millisecond) {
		t.Fatal("a publish of another name woke this one's waiters")
	}
	done1()
	done2()

	// A holder joining wakes too.
	e, err := b.Lookup(ctx, o.Ref())
	if err != nil {
		t.Fatal(err)
	}
	w, done := m.Changed(1000, "w")
	if err := b.AddHolder(ctx, e); err != nil {
		t.Fatal(err)
	}
	if !closedWithin(w, 10*time.Second) {
		t.Fatal("a holder of the name joining did not wake its waiters")
	}
	done()

	// A version committed by its last shard wakes at each shard's record.
	w, done = m.Changed(1000, "v")
	for shard, d := range []*Directory{a, b} {
		v, _ := object("v", 3000)
		v.Version, v.Shard, v.Shards = 1, uint32(shard), 2
		mustPublish(t, ctx, d, v)
		if !closedWithin(w, 10*time.Second) {
			t.Fatalf("shard %d of v1 did not wake the name's waiters", shard)
		}
		done()
		w, done = m.Changed(1000, "v")
	}
	// The commit (the latest record) may follow the last shard's record.
	if _, ok := m.Latest(1000, "v"); !ok && !closedWithin(w, 10*time.Second) {
		t.Fatal("the commit of v1 did not wake the name's waiters")
	}
	done()
	if l, ok := m.Latest(1000, "v"); !ok || l.Version != 1 {
		t.Fatalf("the mirror's latest of v: %+v %v", l, ok)
	}

	// etcd away and back: the mirror loads afresh and wakes every waiter,
	// as a change may have hidden in the outage.
	w, done = m.Changed(1000, "y")
	srv.Kill()
	eventually(t, 10*time.Second, "the mirror leaves sync with etcd down", func() bool { return !m.Synced() })
	srv.Restart()
	if !closedWithin(w, 30*time.Second) {
		t.Fatal("the mirror's return to sync did not wake the waiters")
	}
	done()
	if !closedWithin(other, 0) {
		t.Fatal("the return to sync did not wake every name's waiters")
	}
	doneOther()
	m.mu.Lock()
	left := len(m.waits)
	m.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d names' channels left after every waiter is done", left)
	}
}

// TestMirrorLiveNodes: the mirror follows the live nodes: those joined
// before its load and after, a node that closes (at once) and one that
// dies (its record expires), each change a new generation; a forged node
// record is left out.
func TestMirrorLiveNodes(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b, c := open(t, srv, "a"), open(t, srv, "b"), open(t, srv, "c")
	ctx := ctxT(t)
	mustJoin(t, ctx, a, "a")
	m := loadedMirror(t, ctx, c)
	live := func(want ...string) {
		t.Helper()
		eventually(t, 10*time.Second, fmt.Sprintf("the mirror's live nodes are %v", want), func() bool {
			got, _, _ := m.LiveNodes()
			return slices.Equal(got, want)
		})
	}
	live("a")
	_, gen, synced := m.LiveNodes()
	if !synced {
		t.Fatal("a loaded mirror says it is not in sync")
	}
	mustJoin(t, ctx, b, "b")
	mustJoin(t, ctx, c, "c")
	live("a", "b", "c")
	if _, g, _ := m.LiveNodes(); g == gen {
		t.Fatal("the nodes changed and the generation did not")
	}
	// A record under node/ that does not verify is no live node.
	if _, err := c.cli.Put(ctx, c.k.node("forged"), `{"name":"forged","control":"10.0.0.9:1"}`); err != nil {
		t.Fatal(err)
	}
	b.Close()
	live("a", "c")
	a.abandon()
	live("c")
}

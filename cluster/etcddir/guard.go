package etcddir

import (
	"bytes"
	"context"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/cudaipc/cudaipc/cluster"
)

// The guard keeps this node's records in the directory as the node wrote
// them. The directory is an index of what nodes hold, and anyone who can
// write to etcd can delete or change its keys; only the cluster secret
// can seal a record. So a node acts on nothing but sealed records: it
// drops a replica only when a tombstone sealed with the secret names its
// incarnation (Delete writes one), and it writes back, within a second of
// its watch seeing the change, every record of its own that went or
// changed otherwise: its node record, its holder, feeder and pin records,
// the object records of the objects it holds, and the latest record of
// the versioned names it holds versions of. The first rewrite of each key
// is logged, later ones are counted in a summary line at most once a
// minute, so that a loop deleting keys does not flood the log.
//
// What a node legitimately stops guarding: an incarnation a tombstone
// names (the owner's delete), a version whose record a commit pruned (the
// latest record's Pruned covers it), an object record replaced by another
// verified incarnation (published where no live node held the old one),
// and what the node withdraws itself (RemoveHolder, deleteOwned).

// heldObj is an object this node holds as the directory records it.
type heldObj struct {
	ref  cluster.Ref
	id   string
	val  []byte // its object record, as sealed
	hkey string // this node's holder record
	hval []byte
}

// latestSeen is the newest verified latest record of a versioned name this
// node holds versions of: what it writes back if the record goes.
type latestSeen struct {
	val     []byte
	version uint64
}

// guardRetry is how soon a rewrite that failed (etcd away, or the key
// changed between its read and its write) is tried again.
const guardRetry = 200 * time.Millisecond

// guardSummary is how often, at most, later rewrites are logged (counted).
const guardSummary = time.Minute

// hold records that this node holds the incarnation sealed in val (the
// object record under ref's key), advertised by hval under hkey: the guard
// writes them back if they go. A versioned name whose latest record this
// node has not seen is looked at once, so that its latest can be written
// back too.
func (d *Directory) hold(ref cluster.Ref, id string, val []byte, hkey string, hval []byte) {
	key := d.k.obj(ref)
	d.mu.Lock()
	defer d.mu.Unlock()
	d.held[key] = &heldObj{ref: ref, id: id, val: val, hkey: hkey, hval: hval}
	if _, ok := d.latestSeen[d.k.latest(ref.Owner, ref.Name)]; ref.Version != 0 && !ok {
		d.markLocked(key)
	}
}

// seeLatest records val, the verified latest record of a name this node
// holds versions of, if it is newer than the one seen.
func (d *Directory) seeLatest(lkey string, val []byte, version uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.seeLatestLocked(lkey, val, version)
}

func (d *Directory) seeLatestLocked(lkey string, val []byte, version uint64) {
	if s, ok := d.latestSeen[lkey]; !ok || version > s.version {
		d.latestSeen[lkey] = latestSeen{val: val, version: version}
	}
}

// forgetLocked stops guarding the held object under key: its object
// record, and this node's holder record of it.
func (d *Directory) forgetLocked(key string) {
	h := d.held[key]
	if h == nil {
		return
	}
	delete(d.held, key)
	delete(d.owned, h.hkey)
	delete(d.deferred, h.hkey)
	delete(d.logged, key)
	delete(d.logged, h.hkey)
	if h.ref.Version != 0 && !d.holdsNameLocked(h.ref.Owner, h.ref.Name) {
		delete(d.latestSeen, d.k.latest(h.ref.Owner, h.ref.Name))
	}
}

// holdsNameLocked reports whether this node holds any object of the name.
func (d *Directory) holdsNameLocked(owner uint32, name string) bool {
	prefix := d.k.objName(owner, name)
	for k := range d.held {
		if strings.HasPrefix(k, prefix) {
			return true
		}
	}
	return false
}

// forgetName stops guarding every object of the name (its owner deletes
// it) and returns their incarnations.
func (d *Directory) forgetName(owner uint32, name string) []string {
	d.guardMu.Lock()
	defer d.guardMu.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	prefix := d.k.objName(owner, name)
	var ids []string
	for k, h := range d.held {
		if strings.HasPrefix(k, prefix) {
			ids = append(ids, h.id)
			d.forgetLocked(k)
		}
	}
	return ids
}

// forgetIDsLocked stops guarding the objects of the name whose
// incarnations a verified tombstone names.
func (d *Directory) forgetIDsLocked(owner uint32, name string, ids []string) {
	prefix := d.k.objName(owner, name)
	for k, h := range d.held {
		if strings.HasPrefix(k, prefix) && slices.Contains(ids, h.id) {
			d.forgetLocked(k)
		}
	}
}

// markLocked asks the guard to look at key.
func (d *Directory) markLocked(key string) {
	d.dirty[key] = struct{}{}
	select {
	case d.kick <- struct{}{}:
	default:
	}
}

// markAll asks the guard to look at every record of this node: after its
// watch lost history, what changed meanwhile is unknown.
func (d *Directory) markAll() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for k := range d.held {
		d.markLocked(k)
	}
	for k := range d.owned {
		d.markLocked(k)
	}
}

// guardWatch follows every key under the prefix and hands the guard those
// of this node's records that went or changed, until ctx is done. After
// its watch broke (etcd away) it resumes where it stopped, or from the
// present when etcd compacted that history away, and looks at every record
// of this node either way: etcd keeps no deletion at or before the
// revision it compacted at, so even a watch resumed at exactly that
// revision can miss one.
func (d *Directory) guardWatch(ctx context.Context) {
	var next int64
	if cctx, cancel, err := d.call(ctx, "guard"); err == nil {
		if r, err := d.cli.Get(cctx, d.k.nodes(), clientv3.WithCountOnly()); err == nil {
			next = r.Header.Revision + 1
		}
		cancel()
	}
	for first := true; ctx.Err() == nil; first = false {
		opts := []clientv3.OpOption{clientv3.WithPrefix()}
		if next > 0 {
			opts = append(opts, clientv3.WithRev(next))
		}
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wc := d.cli.Watch(wctx, d.k.p, opts...)
		if !first || next == 0 {
			d.markAll()
		}
		again := fastFail / 2 // after an error: etcd may be away
	follow:
		for {
			select {
			case p := <-d.guardPause: // tests: a node cut off from etcd
				if !d.pausedGuard(ctx, p) {
					cancel()
					return
				}
				again = 0
				break follow
			case wr, ok := <-wc:
				if !ok {
					break follow
				}
				if wr.CompactRevision != 0 {
					d.log.Warn("the directory guard's watch lost history to compaction: checking every record of this node", "revision", wr.CompactRevision)
					next, again = 0, 0
					break follow
				}
				if wr.Err() != nil {
					break follow
				}
				d.guardEvents(wr.Events)
				if n := len(wr.Events); n > 0 {
					next = wr.Events[n-1].Kv.ModRevision + 1
				}
			}
		}
		cancel()
		select {
		case <-ctx.Done():
		case <-time.After(again):
		}
	}
}

// pausedGuard stops the guard's watch, as if this node were cut off from
// etcd, from when p is held until it is resumed (tests); it is false when
// ctx ended first.
func (d *Directory) pausedGuard(ctx context.Context, p pauseReq) bool {
	close(p.held)
	select {
	case <-p.resume:
		return true
	case <-ctx.Done():
		return false
	}
}

// guardEvents applies verified tombstones (before anything else: the
// owner's delete removes the records in the tombstone's revision) and
// marks this node's records that went or changed.
func (d *Directory) guardEvents(evs []*clientv3.Event) {
	d.mu.Lock()
	defer d.mu.Unlock()
	tombs := d.k.tombs()
	for _, ev := range evs {
		key := string(ev.Kv.Key)
		if ev.Type != mvccpb.PUT || !strings.HasPrefix(key, tombs) {
			continue
		}
		var t cluster.Tombstone
		if err := cluster.Open(d.cfg.Secret, key, ev.Kv.Value, &t); err != nil || d.k.tomb(t.Owner, t.Name) != key {
			d.log.Warn("ignoring a tombstone that does not verify: nothing is deleted", "key", key, "err", err)
			continue
		}
		d.forgetIDsLocked(t.Owner, t.Name, t.IDs)
	}
	for _, ev := range evs {
		key := string(ev.Kv.Key)
		put := ev.Type == mvccpb.PUT
		if v, ok := d.owned[key]; ok {
			if !put || !bytes.Equal(ev.Kv.Value, v) || clientv3.LeaseID(ev.Kv.Lease) != d.lease {
				d.markLocked(key)
			}
			continue
		}
		if h := d.held[key]; h != nil {
			if !put || !bytes.Equal(ev.Kv.Value, h.val) {
				d.markLocked(key)
			}
			continue
		}
		if s, ok := d.latestSeen[key]; ok {
			var l cluster.Latest
			if put && cluster.Open(d.cfg.Secret, key, ev.Kv.Value, &l) == nil && l.Version >= s.version {
				d.seeLatestLocked(key, bytes.Clone(ev.Kv.Value), l.Version)
				continue
			}
			d.markLocked(key)
		}
	}
}

// guardWork writes back the records guardWatch marks, until ctx is done.
// A record whose rewrite fails (etcd away, or changed again meanwhile) is
// tried again after guardRetry.
func (d *Directory) guardWork(ctx context.Context) {
	var retry <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-d.kick:
		case <-retry:
		}
		retry = nil
		d.mu.Lock()
		keys := make([]string, 0, len(d.dirty))
		for k := range d.dirty {
			keys = append(keys, k)
		}
		clear(d.dirty)
		d.mu.Unlock()
		slices.Sort(keys)
		if failed := d.reconcile(ctx, keys); len(failed) > 0 {
			d.mu.Lock()
			for _, k := range failed {
				d.dirty[k] = struct{}{}
			}
			d.mu.Unlock()
			retry = time.After(guardRetry)
		}
	}
}

// reconcile writes back what went or changed of the records keys name,
// returning the keys to try again.
func (d *Directory) reconcile(ctx context.Context, keys []string) (failed []string) {
	objs := map[string]bool{}
	var owned []string
	d.mu.Lock()
	for _, key := range keys {
		switch {
		case d.held[key] != nil:
			objs[key] = true
		case strings.HasPrefix(key, d.k.holders()):
			if ref, _, err := parseRef(strings.TrimPrefix(key, d.k.holders())); err == nil && d.held[d.k.obj(ref)] != nil {
				objs[d.k.obj(ref)] = true
				continue
			}
			owned = append(owned, key)
		case strings.HasPrefix(key, d.k.latests()):
			owner, name, ok := parseLatestKey(strings.TrimPrefix(key, d.k.latests()))
			if !ok {
				continue
			}
			prefix := d.k.objName(owner, name)
			for k := range d.held {
				if strings.HasPrefix(k, prefix) {
					objs[k] = true
					break
				}
			}
		default:
			owned = append(owned, key)
		}
	}
	d.mu.Unlock()
	for _, key := range slices.Sorted(func(yield func(string) bool) {
		for k := range objs {
			if !yield(k) {
				return
			}
		}
	}) {
		if err := d.reconcileHeld(ctx, key); err != nil {
			failed = append(failed, key)
		}
	}
	for _, key := range owned {
		if err := d.reconcileOwned(ctx, key); err != nil {
			failed = append(failed, key)
		}
	}
	return failed
}

// reconcileHeld writes back the object record, this node's holder record
// and (for a versioned name) the latest record of the held object under
// key, where they went or do not verify; it stops guarding the object when
// a verified record says it went legitimately. The write is guarded by
// what it read: a tombstone, a publish or a withdrawal meanwhile makes it
// look again.
func (d *Directory) reconcileHeld(ctx context.Context, key string) error {
	d.guardMu.Lock()
	defer d.guardMu.Unlock()
	d.mu.Lock()
	h := d.held[key]
	lease := d.lease
	var seen latestSeen
	var haveSeen bool
	var lkey string
	if h != nil {
		lkey = d.k.latest(h.ref.Owner, h.ref.Name)
		seen, haveSeen = d.latestSeen[lkey]
	}
	d.mu.Unlock()
	if h == nil {
		return nil
	}
	what := "check the records of " + h.ref.String()
	cctx, cancel, err := d.call(ctx, what)
	if err != nil {
		return err
	}
	defer cancel()
	tkey := d.k.tomb(h.ref.Owner, h.ref.Name)
	r, err := d.cli.Txn(cctx).Then(clientv3.OpGet(key), clientv3.OpGet(h.hkey), clientv3.OpGet(tkey), clientv3.OpGet(lkey)).Commit()
	if err != nil {
		return d.fail(cctx, what, err)
	}
	kv := func(i int) *mvccpb.KeyValue {
		if kvs := r.Responses[i].GetResponseRange().Kvs; len(kvs) > 0 {
			return kvs[0]
		}
		return nil
	}
	obj, hold, tomb, latest := kv(0), kv(1), kv(2), kv(3)
	forget := func() {
		d.mu.Lock()
		d.forgetLocked(key)
		d.mu.Unlock()
	}
	if tomb != nil {
		var t cluster.Tombstone
		if cluster.Open(d.cfg.Secret, tkey, tomb.Value, &t) == nil && slices.Contains(t.IDs, h.id) {
			forget() // the owner deleted it: the watch drops the replica
			return nil
		}
	}
	var l cluster.Latest
	latestOK := latest != nil && cluster.Open(d.cfg.Secret, lkey, latest.Value, &l) == nil
	if h.ref.Version != 0 && obj == nil && latestOK && l.Pruned >= h.ref.Version {
		forget() // a commit pruned its record: the replica goes by keep_last
		return nil
	}
	var ops []clientv3.Op
	var cmps []clientv3.Cmp
	var wrote []string
	unchanged := func(k string, kv *mvccpb.KeyValue) {
		if kv == nil {
			cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(k), "=", 0))
		} else {
			cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(k), "=", kv.ModRevision))
		}
	}
	unchanged(tkey, tomb)
	unchanged(key, obj)
	unchanged(h.hkey, hold)
	if obj == nil || !bytes.Equal(obj.Value, h.val) {
		var o cluster.Object
		switch {
		case obj != nil && cluster.Open(d.cfg.Secret, key, obj.Value, &o) == nil && o.ID != h.id:
			// Another incarnation, published where no live node held this
			// one: the name is that now. The replica stays here, unadvertised.
			forget()
			d.log.Warn("an object this node holds was replaced in the directory by another incarnation: its replica here is no longer advertised",
				"object", h.ref.String(), "held", h.id, "recorded", o.ID)
			if lease != 0 && hold != nil {
				_, _ = d.cli.Txn(cctx).If(clientv3.Compare(clientv3.ModRevision(h.hkey), "=", hold.ModRevision)).Then(clientv3.OpDelete(h.hkey)).Commit()
			}
			return nil
		case obj != nil && o.ID == h.id:
			// The same incarnation sealed again: it verifies; keep it.
		default:
			ops = append(ops, clientv3.OpPut(key, string(h.val)))
			wrote = append(wrote, key)
		}
	}
	if lease != 0 && (hold == nil || !bytes.Equal(hold.Value, h.hval) || clientv3.LeaseID(hold.Lease) != lease) {
		ops = append(ops, clientv3.OpPut(h.hkey, string(h.hval), clientv3.WithLease(lease)))
		wrote = append(wrote, h.hkey)
	}
	if h.ref.Version != 0 {
		switch {
		case latestOK && (!haveSeen || l.Version >= seen.version):
			d.mu.Lock()
			if d.held[key] != nil {
				d.seeLatestLocked(lkey, bytes.Clone(latest.Value), l.Version)
			}
			d.mu.Unlock()
		case haveSeen:
			unchanged(lkey, latest)
			ops = append(ops, clientv3.OpPut(lkey, string(seen.val)))
			wrote = append(wrote, lkey)
		}
	}
	if len(ops) == 0 {
		return nil
	}
	t, err := d.cli.Txn(cctx).If(cmps...).Then(ops...).Commit()
	if err != nil {
		return d.fail(cctx, "write back the records of "+h.ref.String(), err)
	}
	if !t.Succeeded {
		return errGuard // changed since the read: look again
	}
	d.rewritten(wrote)
	return nil
}

// reconcileOwned writes back a record this node keeps on its lease (its
// node record, a feeder or pin record) where it went or changed.
func (d *Directory) reconcileOwned(ctx context.Context, key string) error {
	d.guardMu.Lock()
	defer d.guardMu.Unlock()
	d.mu.Lock()
	val, ok := d.owned[key]
	lease := d.lease
	d.mu.Unlock()
	if !ok || lease == 0 {
		return nil // withdrawn; or no lease, whose grant writes it
	}
	what := "check the record " + key
	cctx, cancel, err := d.call(ctx, what)
	if err != nil {
		return err
	}
	defer cancel()
	r, err := d.cli.Get(cctx, key)
	if err != nil {
		return d.fail(cctx, what, err)
	}
	cmp := clientv3.Compare(clientv3.CreateRevision(key), "=", 0)
	if len(r.Kvs) > 0 {
		kv := r.Kvs[0]
		if bytes.Equal(kv.Value, val) && clientv3.LeaseID(kv.Lease) == lease {
			return nil
		}
		cmp = clientv3.Compare(clientv3.ModRevision(key), "=", kv.ModRevision)
	}
	t, err := d.cli.Txn(cctx).If(cmp).Then(clientv3.OpPut(key, string(val), clientv3.WithLease(lease))).Commit()
	if err != nil {
		return d.fail(cctx, "write back "+key, err)
	}
	if !t.Succeeded {
		return errGuard
	}
	d.rewritten([]string{key})
	return nil
}

// rewritten logs the records written back: each key the first time, later
// rewrites as a count at most once per guardSummary.
func (d *Directory) rewritten(keys []string) {
	d.mu.Lock()
	var first []string
	for _, k := range keys {
		if d.logged[k] {
			d.rewrites++
		} else {
			d.logged[k] = true
			first = append(first, k)
		}
		d.rewriteTotal++
	}
	if len(first) > 0 {
		d.summarized = time.Now() // later rewrites: a summary a while from now
	}
	var again uint64
	if now := time.Now(); d.rewrites > 0 && now.Sub(d.summarized) >= guardSummary {
		again, d.rewrites, d.summarized = d.rewrites, 0, now
	}
	d.mu.Unlock()
	if len(first) > 0 {
		d.log.Warn("records of this node in the directory were deleted or changed, not by a node of the cluster (no cluster secret: by hand, or another etcd user): written back; later rewrites of these are counted, not logged each",
			"keys", first)
	}
	if again > 0 {
		d.log.Warn("records of this node in the directory written back again: something keeps deleting or changing them", "rewrites", again, "within", guardSummary)
	}
}

// Rewrites counts the records the guard wrote back since Open.
func (d *Directory) Rewrites() uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.rewriteTotal
}

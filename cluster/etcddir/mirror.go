package etcddir

import (
	"context"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/connectivity"

	"github.com/cudaipc/cudaipc/cluster"
)

// Mirror is a node's in-memory copy of the directory's object records,
// holders, latest versions and live nodes, so that a get of a name with a
// live holder reads no etcd, and cluster-wide KV block pools place keys on
// the live nodes (LiveNodes) without asking it. It loads the records with one read of their key range
// and follows them with a watch from that read's revision.
//
// A Mirror answers only while it is in sync: after its load, while its
// watch runs and while the client's connection to etcd is up. Any break
// (etcd unreachable, the watch cancelled or compacted past) makes it
// answer nothing until it has loaded the records afresh, so changes made
// while this node could not see them are never missed: it serves at worst
// what etcd said the watch's delivery time ago, never a record that a
// delivered event deleted or replaced. Callers treat its answers as a
// cache: on a miss, or when acting on an answer fails, they read etcd.
// Its methods are safe for concurrent use.
type Mirror struct {
	d *Directory

	mu     sync.Mutex
	synced bool
	rev    int64 // the revision the mirror reflects
	objs   map[cluster.Ref]*mirrorObj
	holds  map[cluster.Ref]map[string]string // holder node → incarnation id
	latest map[ownerName]cluster.Latest
	nodes  map[string]cluster.Node // live nodes' records, by name
	waits  map[ownerName]*nameWait // Changed's channels, by name
	// live is the sorted names of nodes, rebuilt when they change; gen
	// counts those changes.
	live []string
	gen  uint64

	loads  atomic.Uint64
	breaks chan struct{} // signalled when the connection leaves Ready
	pause  chan pauseReq
	stop   context.CancelFunc
	done   chan struct{}
	hits   atomic.Uint64
	misses atomic.Uint64
}

// MirrorMaxRecord bounds the object records a Mirror keeps: a larger one
// (a bundle with a large manifest, an object of very many chunks) is
// looked up in etcd, whose read costs little beside its pull, so that a
// node's memory for the mirror stays a small multiple of the number of
// names rather than of etcd's size.
const MirrorMaxRecord = 16 << 10

type ownerName struct {
	owner uint32
	name  string
}

// nameWait is the channel Changed hands out for a name until its next
// change closes it, and how many callers hold it.
type nameWait struct {
	ch chan struct{}
	n  int
}

// mirrorObj is one object record, verified and decoded as it arrives
// (off the path of the gets that use it).
type mirrorObj struct {
	obj cluster.Object
	rev int64
}

// Mirror starts mirroring the directory's records until ctx is done or
// Close is called. Its first answers come once the records are loaded
// (Synced).
func (d *Directory) Mirror(ctx context.Context) *Mirror {
	ctx, cancel := context.WithCancel(ctx)
	m := &Mirror{d: d, stop: cancel, done: make(chan struct{}), breaks: make(chan struct{}, 1), pause: make(chan pauseReq)}
	go m.follow(ctx)
	go m.watchConn(ctx)
	return m
}

// Close stops the mirror; it answers nothing afterwards.
func (m *Mirror) Close() {
	m.stop()
	<-m.done
}

// The mirrored key range: hold/, latest/, node/ and obj/ sort next to one
// another (feed/ before, pin/ after), so one read and one watch, ordered
// by revision, cover holders, objects and nodes.
func (m *Mirror) span() (from, to string) {
	return m.d.k.holders(), m.d.k.p + "obj0" // '0' follows '/'
}

// follow loads the records and follows the watch, again after every break.
func (m *Mirror) follow(ctx context.Context) {
	defer close(m.done)
	defer m.unsync()
	for ctx.Err() == nil {
		select {
		case p := <-m.pause: // tests: a node cut off from etcd
			if !m.paused(ctx, p) {
				return
			}
		default:
		}
		rev, err := m.load(ctx)
		if err == nil {
			m.watch(ctx, rev)
			m.unsync()
		}
		select {
		case <-ctx.Done():
		case <-time.After(fastFail / 4):
		}
	}
}

// watchConn breaks the mirror's sync whenever the client's connection to
// etcd leaves the Ready state (etcd killed or cut off): the watch itself
// would reconnect silently and replay, but until it has, the mirror may
// lag by the whole outage.
func (m *Mirror) watchConn(ctx context.Context) {
	conn := m.d.cli.ActiveConnection()
	for {
		s := conn.GetState()
		if s != connectivity.Ready {
			m.unsync()
			select {
			case m.breaks <- struct{}{}:
			default:
			}
		}
		if !conn.WaitForStateChange(ctx, s) {
			return
		}
	}
}

func (m *Mirror) unsync() {
	m.mu.Lock()
	m.synced = false
	m.mu.Unlock()
}

// load reads every mirrored record in one request and replaces the
// mirror's contents with them, returning their revision.
func (m *Mirror) load(ctx context.Context) (int64, error) {
	cctx, cancel, err := m.d.call(ctx, "mirror the directory")
	if err != nil {
		return 0, err
	}
	defer cancel()
	from, to := m.span()
	r, err := m.d.cli.Get(cctx, from, clientv3.WithRange(to))
	if err != nil {
		return 0, m.d.fail(cctx, "mirror the directory", err)
	}
	objs := map[cluster.Ref]*mirrorObj{}
	holds := map[cluster.Ref]map[string]string{}
	latest := map[ownerName]cluster.Latest{}
	nodes := map[string]cluster.Node{}
	for _, kv := range r.Kvs {
		m.apply(objs, holds, latest, nodes, mvccpb.PUT, kv)
	}
	m.mu.Lock()
	m.objs, m.holds, m.latest, m.rev = objs, holds, latest, r.Header.Revision
	m.nodes = nodes
	m.nodesChangedLocked()
	m.mu.Unlock()
	m.loads.Add(1)
	return r.Header.Revision, nil
}

// watch applies the changes after rev until the watch breaks.
func (m *Mirror) watch(ctx context.Context, rev int64) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	from, to := m.span()
	wc := m.d.cli.Watch(wctx, from, clientv3.WithRange(to), clientv3.WithRev(rev+1))
	m.mu.Lock()
	m.synced = m.rev == rev
	if m.synced {
		// Loaded afresh: whatever changed while it was out of sync is in.
		for on := range m.waits {
			m.wakeLocked(on)
		}
	}
	m.mu.Unlock()
	for {
		select {
		case <-ctx.Done():
			return
		case <-m.breaks:
			return
		case p := <-m.pause:
			m.paused(ctx, p)
			return
		case wr, ok := <-wc:
			if !ok || wr.Canceled || wr.Err() != nil || wr.CompactRevision != 0 {
				if wr.CompactRevision != 0 {
					m.d.log.Info("the directory mirror lost history to compaction: loading it again", "revision", wr.CompactRevision)
				}
				return
			}
			// etcd answered: calls need not fail fast any more (a get woken
			// by this change looks the name up at once).
			m.d.downUntil.Store(0)
			m.mu.Lock()
			nodes := len(m.nodes)
			changed := false
			for _, ev := range wr.Events {
				if strings.HasPrefix(string(ev.Kv.Key), m.d.k.nodes()) {
					changed = true
				}
				m.apply(m.objs, m.holds, m.latest, m.nodes, ev.Type, ev.Kv)
				m.rev = ev.Kv.ModRevision
				if on, ok := m.nameOf(string(ev.Kv.Key)); ok && ev.Type == mvccpb.PUT {
					m.wakeLocked(on)
				}
			}
			if wr.Header.Revision > m.rev {
				m.rev = wr.Header.Revision
			}
			if changed || nodes != len(m.nodes) {
				m.nodesChangedLocked()
			}
			m.mu.Unlock()
		}
	}
}

// apply records one put or delete of a mirrored key, verifying and
// decoding a record now; a record that does not verify is logged and
// left out, as Lookup does.
func (m *Mirror) apply(objs map[cluster.Ref]*mirrorObj, holds map[cluster.Ref]map[string]string, latest map[ownerName]cluster.Latest, nodes map[string]cluster.Node, typ mvccpb.Event_EventType, kv *mvccpb.KeyValue) {
	key := string(kv.Key)
	k := m.d.k
	switch {
	case strings.HasPrefix(key, k.nodes()):
		name := strings.TrimPrefix(key, k.nodes())
		if typ == mvccpb.DELETE {
			delete(nodes, name)
			return
		}
		var n cluster.Node
		if err := openNode(m.d.cfg.Secret, kv, &n); err != nil || n.Name != name {
			m.d.log.Warn("mirror: ignoring a node record", "key", key, "err", err)
			delete(nodes, name)
			return
		}
		nodes[name] = n
	case strings.HasPrefix(key, k.objects()):
		ref, rest, err := parseRef(strings.TrimPrefix(key, k.objects()))
		if err != nil || rest != "" {
			return
		}
		if typ == mvccpb.DELETE {
			delete(objs, ref)
			return
		}
		if len(kv.Value) > MirrorMaxRecord {
			delete(objs, ref) // a large bundle's record: looked up in etcd
			return
		}
		mo := &mirrorObj{rev: kv.ModRevision}
		if err := cluster.Open(m.d.cfg.Secret, key, kv.Value, &mo.obj); err != nil || mo.obj.Ref() != ref {
			m.d.log.Warn("mirror: ignoring an object record", "key", key, "err", err)
			delete(objs, ref)
			return
		}
		objs[ref] = mo
	case strings.HasPrefix(key, k.holders()):
		ref, node, err := parseRef(strings.TrimPrefix(key, k.holders()))
		if err != nil || node == "" || strings.Contains(node, "/") {
			return
		}
		if typ == mvccpb.DELETE {
			if h := holds[ref]; h != nil {
				delete(h, node)
				if len(h) == 0 {
					delete(holds, ref)
				}
			}
			return
		}
		var h cluster.Holder
		if err := cluster.Open(m.d.cfg.Secret, key, kv.Value, &h); err != nil || h.Node != node || kv.Lease == 0 {
			m.d.log.Warn("mirror: ignoring a holder record", "key", key, "err", err)
			if hs := holds[ref]; hs != nil {
				delete(hs, node)
			}
			return
		}
		if holds[ref] == nil {
			holds[ref] = map[string]string{}
		}
		holds[ref][node] = h.ID
	case strings.HasPrefix(key, k.latests()):
		var l cluster.Latest
		if typ == mvccpb.DELETE {
			owner, name, ok := parseLatestKey(strings.TrimPrefix(key, k.latests()))
			if ok {
				delete(latest, ownerName{owner, name})
			}
			return
		}
		if err := cluster.Open(m.d.cfg.Secret, key, kv.Value, &l); err != nil || k.latest(l.Owner, l.Name) != key {
			m.d.log.Warn("mirror: ignoring a latest record", "key", key, "err", err)
			return
		}
		latest[ownerName{l.Owner, l.Name}] = l
	}
}

// nameOf returns the name a mirrored key is a record of.
func (m *Mirror) nameOf(key string) (ownerName, bool) {
	k := m.d.k
	for _, prefix := range []string{k.objects(), k.holders()} {
		if tail, ok := strings.CutPrefix(key, prefix); ok {
			ref, _, err := parseRef(tail)
			return ownerName{ref.Owner, ref.Name}, err == nil
		}
	}
	if tail, ok := strings.CutPrefix(key, k.latests()); ok {
		owner, name, ok := parseLatestKey(tail)
		return ownerName{owner, name}, ok
	}
	return ownerName{}, false
}

// Changed returns a channel that is closed at the next change the mirror
// sees of owner's name: a record of it written (its object's, a holder's,
// its latest version's, of any version), or the mirror in sync again after
// a break (etcd away, the watch compacted past), which may hide any
// change. A get that waits for the name asks for the channel before it
// looks the name up, so that no change after its look-up goes unseen.
// done forgets the channel; call it once, after the close or not.
func (m *Mirror) Changed(owner uint32, name string) (changed <-chan struct{}, done func()) {
	on := ownerName{owner, name}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.waits == nil {
		m.waits = map[ownerName]*nameWait{}
	}
	w := m.waits[on]
	if w == nil {
		w = &nameWait{ch: make(chan struct{})}
		m.waits[on] = w
	}
	w.n++
	return w.ch, func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		if w.n--; w.n == 0 && m.waits[on] == w {
			delete(m.waits, on)
		}
	}
}

// wakeLocked closes the channel Changed handed out for on, if any.
func (m *Mirror) wakeLocked(on ownerName) {
	if w := m.waits[on]; w != nil {
		close(w.ch)
		delete(m.waits, on)
	}
}

// parseLatestKey parses the tail of a latest/ key, "UID/NAME".
func parseLatestKey(s string) (uint32, string, bool) {
	r, _, err := parseRef(s + "/0/0")
	return r.Owner, r.Name, err == nil
}

// nodesChangedLocked rebuilds the sorted list of live nodes.
func (m *Mirror) nodesChangedLocked() {
	m.live = slices.Sorted(maps.Keys(m.nodes))
	m.gen++
}

// LiveNodes returns the names of the live nodes (their records in the
// directory), sorted, as of the mirror's last load or event, and a number
// that changes whenever they do; the slice is shared: do not modify it.
// Out of sync the mirror keeps the nodes it last knew, and synced is
// false. Cluster-wide KV block pools place keys on these nodes: a stale
// list costs misses, never a wrong block.
func (m *Mirror) LiveNodes() (names []string, gen uint64, synced bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.live, m.gen, m.synced
}

// Synced reports whether the mirror answers now.
func (m *Mirror) Synced() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.synced
}

// Loads counts the times the mirror read every record (its start and
// each resynchronisation): for tests and diagnostics.
func (m *Mirror) Loads() uint64 { return m.loads.Load() }

// Lookup answers Directory.Lookup from the mirror: ok is false when it is
// not in sync, the object is not recorded, its record does not verify,
// or no live node holds its incarnation. Callers then ask the directory.
func (m *Mirror) Lookup(ref cluster.Ref) (e Entry, ok bool) {
	m.mu.Lock()
	mo := m.objs[ref]
	var hs map[string]string
	if m.synced && mo != nil {
		hs = maps.Clone(m.holds[ref])
	}
	synced := m.synced && m.d.reachable()
	m.mu.Unlock()
	if !synced || mo == nil || len(hs) == 0 {
		m.misses.Add(1)
		return e, false
	}
	e.Object, e.Revision = mo.obj, mo.rev
	for node, id := range hs {
		if id == e.ID {
			e.Holders = append(e.Holders, node)
		}
	}
	if len(e.Holders) == 0 {
		m.misses.Add(1)
		return Entry{}, false
	}
	slices.Sort(e.Holders) // key order, as Lookup returns them
	m.hits.Add(1)
	return e, true
}

// Latest answers Directory.Latest from the mirror; ok is false when it is
// not in sync or no version of the name is committed.
func (m *Mirror) Latest(owner uint32, name string) (l cluster.Latest, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.synced || !m.d.reachable() {
		return l, false
	}
	l, ok = m.latest[ownerName{owner, name}]
	return l, ok
}

// Stats returns how many lookups the mirror answered and how many it
// left to etcd.
func (m *Mirror) Stats() (hits, misses uint64) { return m.hits.Load(), m.misses.Load() }

// hold stops the mirror's watch as if this node were cut off from etcd,
// until the returned function is called (tests).
func (m *Mirror) hold() (resume func()) {
	p := pauseReq{held: make(chan struct{}), resume: make(chan struct{})}
	m.pause <- p
	<-p.held
	return func() { close(p.resume) }
}

type pauseReq struct{ held, resume chan struct{} }

// paused keeps the mirror out of sync (cut off from etcd) from when p is
// held until it is resumed (hold); it is false when ctx ended first.
func (m *Mirror) paused(ctx context.Context, p pauseReq) bool {
	m.unsync()
	close(p.held)
	select {
	case <-p.resume:
		return true
	case <-ctx.Done():
		return false
	}
}

// reachable reports whether etcd answered the last call and the client's
// connection to it is up.
func (d *Directory) reachable() bool {
	if until := d.downUntil.Load(); until != 0 && time.Now().UnixNano() < until {
		return false
	}
	return d.cli.ActiveConnection().GetState() == connectivity.Ready
}

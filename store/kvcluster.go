package store

import (
	"context"
	"errors"
	"fmt"
	mbits "math/bits"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
	"github.com/cudaipc/cudaipc/store/internal/blocks"
)

// Cluster-wide KV block pools (docs/kv.md, "Across the cluster"). A pool
// made with PoolCreateRequest.cluster is one pool of that name on every
// live node of the cluster: each key belongs to the node its PoolCluster
// places it on (rendezvous hashing over the directory's live nodes), and
// nothing is recorded per key. The daemon a client asks serves the
// client's keys of this node from its own pool and sends each other owner
// one request for its keys, all at once, bounded by the request's
// timeout:
//
//   - a lookup counts the present prefix: keys this node holds (its own,
//     and copies of other nodes' a get brought here) need no request; the
//     first key absent, or whose node did not answer in time, ends it (a
//     per-key lookup asks each node which of its keys it holds); with pin
//     it brings the blocks found here, as a get does, and pins them;
//   - a get copies the blocks held elsewhere into this node's pool (as
//     its blocks, least recently used first to go), then pins and answers
//     them as its own: the client reads them from this node's memory;
//   - a put copies each key's block to its node (which makes the pool
//     with this pool's shape where it has none);
//   - a delete removes the keys on every live node (their owners, and the
//     copies gets left); an evict evicts here only.
//
// A node that does not answer costs its keys: absent for lookups and
// gets, BlockUnavailable for puts. The cluster side (PoolCluster) moves
// the requests and the blocks; the Replicas methods below serve other
// nodes' requests from this node's pools.

// PoolCluster is a ClusterHook that also spreads cluster-wide KV block
// pools over the cluster's nodes (package cluster/node implements it). A
// store whose hook does not implement it refuses cluster-wide pools. Its
// errors of a node wrap ErrNotFound where that node has no such pool for
// the reader (its keys are absent there), and the protocol's
// ErrUnavailable where it did not answer.
type PoolCluster interface {
	// PlacePool places keys (keyBytes each, end to end) on the cluster's
	// live nodes, which nodes lists (this one among them): owners[i] is
	// key i's node, an index into nodes, or -1 for this node.
	PlacePool(keys []byte, keyBytes int, owners []int32) (nodes []string)
	// LookupPoolAt asks node how many of c's keys, from the first, it
	// holds.
	LookupPoolAt(ctx context.Context, node string, c PoolCall) (int, error)
	// PresentPoolAt asks node which of c's keys it holds.
	PresentPoolAt(ctx context.Context, node string, c PoolCall) ([]bool, error)
	// GetPoolAt asks node for the blocks of c's keys it holds: place is
	// told which, a run of keys at a time (found[k] for key first+k; from
	// several goroutines at once), and returns where each found block of
	// the run goes, in key order (nil: skip it). GetPoolAt returns once
	// they are all there, or fails (blocks partly written).
	GetPoolAt(ctx context.Context, node string, c PoolCall, place func(first int, found []bool) [][]byte) error
	// PutPoolAt stores c's blocks on node and returns each key's status
	// (protocol.BlockStored, BlockExisted, BlockFull). fill writes the
	// blocks of keys first, first+1, ... end to end into buf, as many as
	// it holds (a run of keys at a time: no buffer need hold them all).
	PutPoolAt(ctx context.Context, node string, c PoolCall, fill func(first int, buf []byte)) ([]byte, error)
	// DeletePoolAt removes c's keys on node and returns how many it held.
	DeletePoolAt(ctx context.Context, node string, c PoolCall) (int, error)
}

// PoolCall is a request of a cluster-wide pool for keys one node owns.
type PoolCall struct {
	// Reader is the uid of the client it serves: the owner's pool rules
	// apply to it as to its own clients.
	Reader uint32
	// Pool is the pool's qualified name; KeyBytes its key size, Keys the
	// keys end to end.
	Pool     string
	KeyBytes int
	Keys     []byte
	// BlockBytes, Capacity and Shared are the pool's shape: the owner
	// checks its pool against it, and a put makes the pool with it where
	// the owner has none.
	BlockBytes, Capacity int64
	Shared               bool
}

// clusterPoolRequest reports whether req is a block request of a
// cluster-wide pool this connection names (without checking its rights:
// the request does).
func (cn *conn) clusterPoolRequest(req *storev1.Request) bool {
	var pool string
	switch b := req.GetBody().(type) {
	case *storev1.Request_BlockLookup:
		pool = b.BlockLookup.GetPool()
	case *storev1.Request_BlockGet:
		pool = b.BlockGet.GetPool()
	case *storev1.Request_BlockDelete:
		pool = b.BlockDelete.GetPool()
	default:
		return false
	}
	name, err := cn.qualify(pool, false)
	if err != nil {
		return false
	}
	t := &cn.s.pools
	t.mu.RLock()
	defer t.mu.RUnlock()
	p := t.byName[name]
	return p != nil && p.cluster
}

// poolTimeout is a block request's timeout for other nodes.
func poolTimeout(ms, def int64) time.Duration {
	if ms <= 0 {
		ms = def
	}
	return time.Duration(ms) * time.Millisecond
}

// call returns the call of keys idx of keys for this pool.
func (p *blockPool) call(reader uint32, keys blocks.Keys, idx []int) PoolCall {
	c := PoolCall{Reader: reader, Pool: p.name, KeyBytes: keys.Size, Keys: make([]byte, 0, len(idx)*keys.Size),
		BlockBytes: p.blockBytes, Capacity: p.capacity, Shared: p.shared}
	for _, i := range idx {
		c.Keys = append(c.Keys, keys.Data[i*keys.Size:(i+1)*keys.Size]...)
	}
	return c
}

// place groups keys idx of keys by the node they belong to: byNode[n]
// holds those of nodes[n], mine those of this node.
func (cn *conn) place(keys blocks.Keys, idx []int) (nodes []string, byNode [][]int, mine []int) {
	pc := cn.s.cfg.Cluster.(PoolCluster)
	data := make([]byte, 0, len(idx)*keys.Size)
	for _, i := range idx {
		data = append(data, keys.Data[i*keys.Size:(i+1)*keys.Size]...)
	}
	owners := make([]int32, len(idx))
	nodes = pc.PlacePool(data, keys.Size, owners)
	byNode = make([][]int, len(nodes))
	for k, o := range owners {
		if o < 0 {
			mine = append(mine, idx[k])
		} else {
			byNode[o] = append(byNode[o], idx[k])
		}
	}
	return nodes, byNode, mine
}

// failures collects why nodes did not answer, for an answer's message.
type failures struct {
	mu   sync.Mutex
	keys int
	why  []string
}

func (f *failures) add(node string, keys int, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.keys += keys
	f.why = append(f.why, fmt.Sprintf("node %s (%d keys): %v", node, keys, err))
}

func (f *failures) String() string {
	slices.Sort(f.why)
	return strings.Join(f.why, "; ")
}

// remoteResult counts a request to another node in the metrics and says
// whether it failed for want of an answer (not for want of the pool).
func (cn *conn) remoteResult(op string, err error) (unavailable bool) {
	result := "ok"
	switch {
	case errors.Is(err, ErrNotFound):
		result = "absent"
	case err != nil:
		result, unavailable = "unavailable", true
	}
	cn.s.metrics.pools.remote.WithLabelValues(op, result).Inc()
	return unavailable
}

// eachNode runs f for each node with keys, at once, and waits.
func eachNode(nodes []string, byNode [][]int, f func(node string, idx []int)) {
	var wg sync.WaitGroup
	for n, idx := range byNode {
		if len(idx) > 0 {
			wg.Go(func() { f(nodes[n], idx) })
		}
	}
	wg.Wait()
}

// clusterLookup counts the present prefix of keys in the cluster-wide
// pool p, or with per_key says which keys are present, pinning here what
// it found when asked (see the top of this file).
func (cn *conn) clusterLookup(p *blockPool, keys blocks.Keys, r *storev1.BlockLookupRequest, bulk *os.File) (*storev1.BlockLookupResponse, error) {
	n := keys.Len()
	var (
		fail  failures
		found int
		bits  []byte
		held  []int32
	)
	switch {
	case r.GetPin():
		// Pinned here: the blocks found elsewhere are brought here first.
		var want blocks.Keys
		if r.GetPerKey() {
			want = keys
		} else {
			want = keys.Slice(0, cn.clusterPrefix(p, keys, r.GetTimeoutMs(), &fail))
		}
		slots := make([]int32, want.Len())
		_, unavailable, why := cn.acquireCluster(p, want, slots, poolTimeout(r.GetTimeoutMs(), protocol.DefaultPoolTimeoutMs))
		if unavailable > 0 {
			fail.why = append(fail.why, why)
		}
		found = len(slots)
		if r.GetPerKey() {
			bits = make([]byte, (n+7)/8)
		}
		for i, j := range slots {
			switch {
			case j != blocks.None && bits != nil:
				bits[i>>3] |= 1 << (i & 7)
				held = append(held, j)
			case j != blocks.None && i < found:
				held = append(held, j)
			case j != blocks.None:
				p.unpin([]int32{j}) // past the prefix: not the lookup's
			default:
				found = min(found, i)
			}
		}
	case r.GetPerKey():
		bits = cn.clusterPresent(p, keys, r.GetTimeoutMs(), &fail)
		found = n
		for i := range n {
			if bits[i>>3]&(1<<(i&7)) == 0 {
				found = i
				break
			}
		}
	default:
		found = cn.clusterPrefix(p, keys, r.GetTimeoutMs(), &fail)
	}
	resp := &storev1.BlockLookupResponse{Found: uint32(found), Unavailable: fail.String()}
	hit := found
	if bits != nil {
		hit = 0
		for _, b := range bits {
			hit += mbits.OnesCount8(b)
		}
		resp.PresentCount = uint32(hit)
		var err error
		if resp.Present, err = writeBlob("present", bits, bulk, r.GetPresentAt()); err != nil {
			p.unpin(held)
			return nil, err
		}
	}
	if len(held) > 0 {
		var err error
		if resp.Pin, err = cn.ss.addPin(p, held, pinTimeout(r.GetPinTimeoutMs())); err != nil {
			return nil, err
		}
	}
	p.mu.Lock()
	p.hits += uint64(hit)
	p.misses += uint64(n - hit)
	p.mu.Unlock()
	m := cn.s.metrics.pools
	m.hits.WithLabelValues(p.device, "lookup").Add(float64(hit))
	m.misses.WithLabelValues(p.device, "lookup").Add(float64(n - hit))
	if len(fail.why) > 0 {
		cn.log.Debug("KV pool lookup: nodes did not answer", "pool", p.name, "why", resp.Unavailable)
	}
	return resp, nil
}

// clusterPrefix counts the present prefix of keys in the cluster-wide
// pool p: keys held here need no request, the first absent key of this
// node's ends it, and each other node is asked for its keys before that,
// within timeoutMs; a node that did not answer ends it at its first key.
func (cn *conn) clusterPrefix(p *blockPool, keys blocks.Keys, timeoutMs int64, fail *failures) int {
	n := keys.Len()
	p.mu.Lock()
	found := p.idx.Prefix(keys)
	var ask []int
	for i := found; i < n; i++ {
		if i > found && p.idx.Prefix(keys.Slice(i, i+1)) == 1 {
			continue
		}
		ask = append(ask, i)
	}
	p.mu.Unlock()
	if len(ask) == 0 {
		return found
	}
	nodes, byNode, mine := cn.place(keys, ask)
	end := n
	if len(mine) > 0 {
		end = mine[0]
	}
	bound := end
	ctx, cancel := context.WithTimeout(cn.ss.ctx, poolTimeout(timeoutMs, protocol.DefaultPoolLookupTimeoutMs))
	defer cancel()
	var mu sync.Mutex
	eachNode(nodes, byNode, func(node string, idx []int) {
		if k, _ := slices.BinarySearch(idx, bound); k < len(idx) {
			idx = idx[:k] // keys past this node's first absent key count for nothing
		}
		if len(idx) == 0 {
			return
		}
		got, err := cn.s.cfg.Cluster.(PoolCluster).LookupPoolAt(ctx, node, p.call(cn.ss.peer.uid, keys, idx))
		if cn.remoteResult("lookup", err) {
			fail.add(node, len(idx), err)
		}
		if err != nil {
			got = 0
		}
		if got < len(idx) {
			mu.Lock()
			end = min(end, idx[got])
			mu.Unlock()
		}
	})
	return end
}

// clusterPresent says which of keys the cluster-wide pool p holds, a bit
// a key: keys held here need no request, each other node is asked for its
// keys within timeoutMs, and a node that did not answer holds none.
func (cn *conn) clusterPresent(p *blockPool, keys blocks.Keys, timeoutMs int64, fail *failures) []byte {
	bits := make([]byte, (keys.Len()+7)/8)
	p.mu.Lock()
	p.idx.Present(keys, bits)
	p.mu.Unlock()
	var ask []int
	for i := range keys.Len() {
		if bits[i>>3]&(1<<(i&7)) == 0 {
			ask = append(ask, i)
		}
	}
	if len(ask) == 0 {
		return bits
	}
	nodes, byNode, _ := cn.place(keys, ask)
	ctx, cancel := context.WithTimeout(cn.ss.ctx, poolTimeout(timeoutMs, protocol.DefaultPoolLookupTimeoutMs))
	defer cancel()
	var mu sync.Mutex
	eachNode(nodes, byNode, func(node string, idx []int) {
		got, err := cn.s.cfg.Cluster.(PoolCluster).PresentPoolAt(ctx, node, p.call(cn.ss.peer.uid, keys, idx))
		if cn.remoteResult("lookup", err) {
			fail.add(node, len(idx), err)
		}
		if err != nil {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		for k, i := range idx {
			if got[k] {
				bits[i>>3] |= 1 << (i & 7)
			}
		}
	})
	return bits
}

// acquireCluster pins the blocks of keys this node holds and copies those
// held on other nodes into its pool, pinning them too: slots[i] is key
// i's pinned slot, or blocks.None. It returns how many it found, how many
// of the others are absent because their node did not answer, and why.
func (cn *conn) acquireCluster(p *blockPool, keys blocks.Keys, slots []int32, timeout time.Duration) (found, unavailable int, why string) {
	p.mu.Lock()
	found = p.idx.Acquire(keys, slots)
	p.mu.Unlock()
	if found == keys.Len() {
		return found, 0, ""
	}
	var missing []int
	for i, s := range slots {
		if s == blocks.None {
			missing = append(missing, i)
		}
	}
	nodes, byNode, _ := cn.place(keys, missing)
	if !p.enter() {
		return found, 0, "" // deleted meanwhile: nothing more is stored in it
	}
	defer cn.s.leavePool(p)
	ctx, cancel := context.WithTimeout(cn.ss.ctx, timeout)
	defer cancel()
	var (
		fail failures
		mu   sync.Mutex
	)
	eachNode(nodes, byNode, func(node string, idx []int) {
		var (
			pmu  sync.Mutex
			got  []int   // keys of idx the node sent, by their index in keys
			rs   []int32 // their slots here, reserved
			sub  = blocks.Keys{Size: keys.Size}
			kept int
		)
		err := cn.s.cfg.Cluster.(PoolCluster).GetPoolAt(ctx, node, p.call(cn.ss.peer.uid, keys, idx), func(first int, in []bool) [][]byte {
			run := blocks.Keys{Size: keys.Size}
			var runGot []int
			for k, f := range in {
				if f {
					i := idx[first+k]
					runGot = append(runGot, i)
					run.Data = append(run.Data, keys.Data[i*keys.Size:(i+1)*keys.Size]...)
				}
			}
			runSlots := make([]int32, len(runGot))
			st := make([]blocks.Status, len(runGot))
			p.mu.Lock()
			reserved, evicted := p.idx.Reserve(run, runSlots, st)
			p.evictions += uint64(evicted)
			p.mu.Unlock()
			cn.s.metrics.pools.evictions.WithLabelValues(p.device).Add(float64(evicted))
			pmu.Lock()
			got, rs, kept = append(got, runGot...), append(rs, runSlots...), kept+reserved
			sub.Data = append(sub.Data, run.Data...)
			pmu.Unlock()
			dst := make([][]byte, len(runGot))
			for k, j := range runSlots {
				if j != blocks.None {
					off := int64(j) * p.slotBytes
					dst[k] = p.mem[off : off+p.blockBytes]
				}
			}
			return dst
		})
		if cn.remoteResult("get", err) {
			fail.add(node, len(idx), err)
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		if err != nil {
			p.idx.Abort(rs)
			return
		}
		p.idx.Commit(rs)
		p.stored += uint64(kept)
		if len(got) == 0 {
			return
		}
		pinned := make([]int32, len(got))
		n := p.idx.Acquire(sub, pinned)
		for k, i := range got {
			slots[i] = pinned[k]
		}
		mu.Lock()
		found += n
		mu.Unlock()
	})
	return found, fail.keys, fail.String()
}

// clusterPut stores the blocks of keys (key i's from source block ids[i])
// on their nodes, this node's in its own pool, and returns each key's
// status.
func (cn *conn) clusterPut(p *blockPool, keys blocks.Keys, ids []uint32, parts []part, mems [][]byte, timeoutMs int64) []byte {
	all := make([]int, keys.Len())
	for i := range all {
		all[i] = i
	}
	nodes, byNode, mine := cn.place(keys, all)
	status := make([]byte, keys.Len())
	ctx, cancel := context.WithTimeout(cn.ss.ctx, poolTimeout(timeoutMs, protocol.DefaultPoolTimeoutMs))
	defer cancel()
	var wg sync.WaitGroup
	if len(mine) > 0 {
		wg.Go(func() {
			sub := p.call(0, keys, mine)
			subIDs := make([]uint32, len(mine))
			for k, i := range mine {
				subIDs[k] = ids[i]
			}
			st, err := cn.s.putLocal(p, blocks.Keys{Data: sub.Keys, Size: keys.Size}, subIDs, parts, mems)
			for k, i := range mine {
				if err != nil {
					status[i] = protocol.BlockFull // the pool went: nothing stored
				} else {
					status[i] = st[k]
				}
			}
		})
	}
	eachNode(nodes, byNode, func(node string, idx []int) {
		st, err := cn.s.cfg.Cluster.(PoolCluster).PutPoolAt(ctx, node, p.call(cn.ss.peer.uid, keys, idx), func(first int, buf []byte) {
			for k := range int64(len(buf)) / p.blockBytes {
				copyBlock(buf[k*p.blockBytes:(k+1)*p.blockBytes], int64(ids[idx[first+int(k)]]), parts, mems)
			}
		})
		cn.remoteResult("put", err)
		for k, i := range idx {
			if err != nil || len(st) != len(idx) {
				status[i] = protocol.BlockUnavailable
			} else {
				status[i] = st[k]
			}
		}
		if err != nil {
			cn.log.Debug("KV pool put: a node did not store its keys", "pool", p.name, "node", node, "keys", len(idx), "err", err)
		}
	})
	wg.Wait()
	return status
}

// clusterDelete removes keys on every other live node (this node's pool
// deleted them here already): on their owners, and wherever a get left
// copies. It returns how many blocks they held.
func (cn *conn) clusterDelete(p *blockPool, keys blocks.Keys) int {
	all := make([]int, keys.Len())
	for i := range all {
		all[i] = i
	}
	owners := make([]int32, 1)
	nodes := cn.s.cfg.Cluster.(PoolCluster).PlacePool(keys.Data[:keys.Size], keys.Size, owners)
	byNode := make([][]int, len(nodes))
	for n := range nodes {
		byNode[n] = all
	}
	if self := slices.Index(nodes, cn.s.nodeName()); self >= 0 {
		byNode[self] = nil // this node deleted them already
	}
	ctx, cancel := context.WithTimeout(cn.ss.ctx, poolTimeout(0, protocol.DefaultPoolTimeoutMs))
	defer cancel()
	var mu sync.Mutex
	total := 0
	eachNode(nodes, byNode, func(node string, idx []int) {
		n, err := cn.s.cfg.Cluster.(PoolCluster).DeletePoolAt(ctx, node, p.call(cn.ss.peer.uid, keys, idx))
		cn.remoteResult("delete", err)
		mu.Lock()
		total += n
		mu.Unlock()
	})
	return total
}

// Serving other nodes' requests.

// clusterPool returns this node's pool of c for c.Reader (write: to put
// or delete), checking that it is cluster-wide and of c's shape, and c's
// keys.
func (s *Store) clusterPool(c PoolCall, write bool) (*blockPool, blocks.Keys, error) {
	p, err := s.poolFor(c.Reader, c.Pool, write)
	if err != nil {
		return nil, blocks.Keys{}, err
	}
	switch {
	case !p.cluster:
		return nil, blocks.Keys{}, fmt.Errorf("KV block pool %q is not cluster-wide on this node", c.Pool)
	case p.blockBytes != c.BlockBytes || p.keyBytes != c.KeyBytes:
		return nil, blocks.Keys{}, fmt.Errorf("KV block pool %q is of blocks of %d bytes and keys of %d here, not %d and %d",
			c.Pool, p.blockBytes, p.keyBytes, c.BlockBytes, c.KeyBytes)
	}
	keys, err := p.parseKeys(c.Keys, uint32(len(c.Keys)/max(c.KeyBytes, 1)))
	return p, keys, err
}

// LookupPool answers another node's lookup in a cluster-wide pool: how
// many of c's keys, from the first, this node holds. It fails wrapping
// ErrNotFound where this node has no such pool for c.Reader.
func (rp *Replicas) LookupPool(c PoolCall) (int, error) {
	p, keys, err := rp.s.clusterPool(c, false)
	if err != nil {
		return 0, err
	}
	p.mu.Lock()
	n := p.idx.Prefix(keys)
	p.hits += uint64(n)
	p.misses += uint64(keys.Len() - n)
	p.mu.Unlock()
	m := rp.s.metrics.pools
	m.hits.WithLabelValues(p.device, "lookup").Add(float64(n))
	m.misses.WithLabelValues(p.device, "lookup").Add(float64(keys.Len() - n))
	return n, nil
}

// PresentPool answers another node's per-key lookup in a cluster-wide
// pool: which of c's keys this node holds. It fails as LookupPool does.
func (rp *Replicas) PresentPool(c PoolCall) ([]bool, error) {
	p, keys, err := rp.s.clusterPool(c, false)
	if err != nil {
		return nil, err
	}
	bits := make([]byte, (keys.Len()+7)/8)
	p.mu.Lock()
	_, n := p.idx.Present(keys, bits)
	p.hits += uint64(n)
	p.misses += uint64(keys.Len() - n)
	p.mu.Unlock()
	m := rp.s.metrics.pools
	m.hits.WithLabelValues(p.device, "lookup").Add(float64(n))
	m.misses.WithLabelValues(p.device, "lookup").Add(float64(keys.Len() - n))
	out := make([]bool, keys.Len())
	for i := range out {
		out[i] = bits[i>>3]&(1<<(i&7)) != 0
	}
	return out, nil
}

// GatherPool answers another node's get in a cluster-wide pool: it copies
// the blocks of c's keys this node holds, end to end in key order, into
// the buffer that buffer returns for their size (not called when none is
// held), and says which keys it held. It fails as LookupPool does.
func (rp *Replicas) GatherPool(c PoolCall, buffer func(size int64) ([]byte, error)) ([]bool, error) {
	s := rp.s
	p, keys, err := s.clusterPool(c, false)
	if err != nil {
		return nil, err
	}
	if !p.enter() {
		return nil, fmt.Errorf("KV block pool %q: %w: %w", c.Pool, errPoolGone, ErrNotFound)
	}
	defer s.leavePool(p)
	slots := make([]int32, keys.Len())
	p.mu.Lock()
	n := p.idx.Acquire(keys, slots)
	p.hits += uint64(n)
	p.misses += uint64(keys.Len() - n)
	p.mu.Unlock()
	defer p.unpin(slots)
	m := s.metrics.pools
	m.hits.WithLabelValues(p.device, "get").Add(float64(n))
	m.misses.WithLabelValues(p.device, "get").Add(float64(keys.Len() - n))
	found := make([]bool, len(slots))
	if n == 0 {
		return found, nil
	}
	buf, err := buffer(int64(n) * p.blockBytes)
	if err != nil {
		return nil, err
	}
	k := int64(0)
	for i, j := range slots {
		if j == blocks.None {
			continue
		}
		found[i] = true
		off := int64(j) * p.slotBytes
		copy(buf[k*p.blockBytes:(k+1)*p.blockBytes], p.mem[off:off+p.blockBytes])
		k++
	}
	m.getBytes.WithLabelValues(p.device).Add(float64(int64(n) * p.blockBytes))
	return found, nil
}

// StorePool answers another node's put in a cluster-wide pool: it
// reserves a block for each of c's keys absent here (making the pool with
// c's shape, owned by the uid its name says, where this node has none),
// has fill write the blocks (dst[i] for key i; nil for a key not
// reserved), and makes them readable; on fill's failure none is. It
// returns each key's status.
func (rp *Replicas) StorePool(c PoolCall, fill func(dst [][]byte) error) ([]byte, error) {
	s := rp.s
	p, keys, err := s.clusterPool(c, true)
	if errors.Is(err, ErrNotFound) {
		s.pools.mu.RLock()
		exists := s.pools.byName[c.Pool] != nil
		s.pools.mu.RUnlock()
		owner, _, _ := protocol.SplitOwner(c.Pool)
		if exists || c.Reader != owner && c.Reader != 0 {
			return nil, err
		}
		if _, err := s.createPool(owner, &storev1.PoolCreateRequest{Name: c.Pool, BlockBytes: uint64(c.BlockBytes), KeyBytes: uint32(c.KeyBytes),
			Capacity: uint64(c.Capacity), Shared: c.Shared, Cluster: true}, func() bool { return false }, s.log.With("for", "a put of another node")); err != nil {
			return nil, fmt.Errorf("making the cluster-wide pool %q here: %w", c.Pool, err)
		}
		p, keys, err = s.clusterPool(c, true)
	}
	if err != nil {
		return nil, err
	}
	if !p.enter() {
		return nil, fmt.Errorf("KV block pool %q: %w: %w", c.Pool, errPoolGone, ErrNotFound)
	}
	defer s.leavePool(p)
	slots := make([]int32, keys.Len())
	status := make([]blocks.Status, keys.Len())
	p.mu.Lock()
	stored, evicted := p.idx.Reserve(keys, slots, status)
	p.evictions += uint64(evicted)
	p.mu.Unlock()
	dst := make([][]byte, len(slots))
	for i, j := range slots {
		if j != blocks.None {
			off := int64(j) * p.slotBytes
			dst[i] = p.mem[off : off+p.blockBytes]
		}
	}
	if stored > 0 {
		if err := fill(dst); err != nil {
			p.mu.Lock()
			p.idx.Abort(slots)
			p.mu.Unlock()
			return nil, err
		}
	}
	p.mu.Lock()
	p.idx.Commit(slots)
	p.stored += uint64(stored)
	p.mu.Unlock()
	s.metrics.pools.putDone(p, stored, evicted)
	out := make([]byte, len(status))
	for i, st := range status {
		out[i] = byte(st)
	}
	return out, nil
}

// DeletePool answers another node's delete in a cluster-wide pool: it
// removes c's keys here and returns how many it held.
func (rp *Replicas) DeletePool(c PoolCall) (int, error) {
	p, keys, err := rp.s.clusterPool(c, true)
	if err != nil {
		return 0, err
	}
	p.mu.Lock()
	n := p.idx.Delete(keys)
	p.mu.Unlock()
	return n, nil
}

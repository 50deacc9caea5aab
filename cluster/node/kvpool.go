package node

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/store"
)

// Cluster-wide KV block pools (docs/kv.md, "Across the cluster"). As the
// store's PoolCluster, the node places keys on the live nodes its mirror
// of the directory knows (cluster.Placement) and sends other nodes'
// requests over the control channel (cluster.Puller's pool calls), cut
// into calls of at most cluster.MaxPoolCallKeys keys and maxPoolCallBytes
// bytes of blocks; as a cluster.PoolSource it serves other nodes' requests
// from the store's pools, its blocks inline in the answer when they fit
// cluster.MaxInline, else staged in a buffer of the node's (kvstage.go)
// exposed through UCX.

var (
	_ store.PoolCluster  = (*Node)(nil)
	_ cluster.PoolSource = source{}
)

// maxPoolCallBytes bounds the blocks of one call: a put's or a get's
// staging buffer. Tests lower it (SetMaxPoolCallBytes).
var maxPoolCallBytes int64 = 256 << 20

const (
	// poolDownFor is how long a node that did not answer a pool call is
	// taken as down: calls to it fail at once meanwhile, so that a dead
	// node whose record has not expired yet costs lookups no time.
	poolDownFor = 500 * time.Millisecond
)

// poolPlacement is the placement over the live nodes, rebuilt when they
// change, and the nodes taken as down.
type poolPlacement struct {
	mu   sync.Mutex
	gen  uint64
	p    *cluster.Placement
	self int
	down map[string]time.Time
}

// placement returns the placement over the live nodes (this one always
// among them) and this node's index in it.
func (n *Node) placement() (*cluster.Placement, int) {
	names, gen, _ := n.mirror.LiveNodes()
	pp := &n.pools
	pp.mu.Lock()
	defer pp.mu.Unlock()
	if pp.p != nil && pp.gen == gen {
		return pp.p, pp.self
	}
	self := n.cfg.Directory.Node
	if _, ok := slices.BinarySearch(names, self); !ok {
		names = append(slices.Clone(names), self)
		slices.Sort(names)
	}
	pp.p, pp.gen = cluster.NewPlacement(names), gen
	pp.self, _ = slices.BinarySearch(names, self)
	return pp.p, pp.self
}

// PlacePool implements store.PoolCluster.
func (n *Node) PlacePool(keys []byte, keyBytes int, owners []int32) []string {
	p, self := n.placement()
	for i := range owners {
		o := p.Owner(keys[i*keyBytes : (i+1)*keyBytes])
		if o == self {
			o = -1
		}
		owners[i] = int32(o)
	}
	return p.Nodes()
}

// poolCall runs f, a call to node, unless node did not answer a call
// lately; a call that gets no answer marks it down for poolDownFor.
func (n *Node) poolCall(node string, f func() error) error {
	pp := &n.pools
	pp.mu.Lock()
	until, down := pp.down[node]
	pp.mu.Unlock()
	if down && time.Now().Before(until) {
		return fmt.Errorf("%w: node %s did not answer a request less than %v ago", cluster.ErrPoolNode, node, poolDownFor)
	}
	err := f()
	if errors.Is(err, cluster.ErrPoolNode) {
		pp.mu.Lock()
		if pp.down == nil {
			pp.down = map[string]time.Time{}
		}
		pp.down[node] = time.Now().Add(poolDownFor)
		pp.mu.Unlock()
	}
	return err
}

func clusterCall(c store.PoolCall) cluster.PoolCall {
	return cluster.PoolCall{Reader: c.Reader, Pool: c.Pool, KeyBytes: c.KeyBytes, Keys: c.Keys,
		Shape: cluster.PoolShape{BlockBytes: c.BlockBytes, Capacity: c.Capacity, Shared: c.Shared}}
}

func storeCall(c cluster.PoolCall) store.PoolCall {
	return store.PoolCall{Reader: c.Reader, Pool: c.Pool, KeyBytes: c.KeyBytes, Keys: c.Keys,
		BlockBytes: c.Shape.BlockBytes, Capacity: c.Shape.Capacity, Shared: c.Shape.Shared}
}

// poolSlices cuts c's keys into calls of at most cluster.MaxPoolCallKeys
// keys and, with blocks, maxPoolCallBytes bytes of them: [from, to) each.
func poolSlices(c store.PoolCall, blocks bool) [][2]int {
	count := len(c.Keys) / c.KeyBytes
	per := cluster.MaxPoolCallKeys
	if blocks {
		per = int(max(1, min(int64(per), maxPoolCallBytes/c.BlockBytes)))
	}
	var out [][2]int
	for i := 0; i < count; i += per {
		out = append(out, [2]int{i, min(i+per, count)})
	}
	return out
}

func subCall(c store.PoolCall, r [2]int) cluster.PoolCall {
	cc := clusterCall(c)
	cc.Keys = c.Keys[r[0]*c.KeyBytes : r[1]*c.KeyBytes]
	return cc
}

// LookupPoolAt implements store.PoolCluster.
func (n *Node) LookupPoolAt(ctx context.Context, node string, c store.PoolCall) (int, error) {
	found := 0
	for _, r := range poolSlices(c, false) {
		var got int
		err := n.poolCall(node, func() (err error) {
			got, err = n.p.PoolLookup(ctx, node, subCall(c, r))
			return err
		})
		if err != nil {
			return found, err
		}
		if found += got; got < r[1]-r[0] {
			break
		}
	}
	return found, nil
}

// PresentPoolAt implements store.PoolCluster.
func (n *Node) PresentPoolAt(ctx context.Context, node string, c store.PoolCall) ([]bool, error) {
	var out []bool
	for _, r := range poolSlices(c, false) {
		var got []bool
		err := n.poolCall(node, func() (err error) {
			got, err = n.p.PoolPresent(ctx, node, subCall(c, r))
			return err
		})
		if err != nil {
			return nil, err
		}
		out = append(out, got...)
	}
	return out, nil
}

// GetPoolAt implements store.PoolCluster: calls of more keys or bytes
// than one may carry go two at a time, so that one's transfer overlaps
// the next one's request and gathering.
func (n *Node) GetPoolAt(ctx context.Context, node string, c store.PoolCall, place func(first int, found []bool) [][]byte) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sem := make(chan struct{}, 2)
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for _, r := range poolSlices(c, true) {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		wg.Go(func() {
			defer func() { <-sem }()
			err := n.poolCall(node, func() error {
				return n.p.PoolGet(ctx, node, subCall(c, r), func(found []bool) [][]byte {
					dst := place(r[0], found)
					if h := n.poolGetHook.Load(); h != nil {
						(*h)(node)
					}
					return dst
				})
			})
			if err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
				cancel()
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return ctx.Err()
}

func countTrue(b []bool) int {
	n := 0
	for _, v := range b {
		if v {
			n++
		}
	}
	return n
}

// PutPoolAt implements store.PoolCluster: each call's blocks go inline
// when they fit, else through a staging buffer of that call's blocks,
// which the node fetches from.
func (n *Node) PutPoolAt(ctx context.Context, node string, c store.PoolCall, fill func(first int, buf []byte)) ([]byte, error) {
	timeout := cluster.DefaultPoolStoreTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = max(time.Until(dl), time.Millisecond)
	}
	var status []byte
	for _, r := range poolSlices(c, true) {
		st, err := n.putSlice(ctx, node, c, r, fill, timeout)
		if err != nil {
			return nil, err
		}
		status = append(status, st...)
	}
	return status, nil
}

// putSlice puts the blocks of keys [r[0], r[1]) of c on node, in one call.
func (n *Node) putSlice(ctx context.Context, node string, c store.PoolCall, r [2]int, fill func(int, []byte), timeout time.Duration) ([]byte, error) {
	size := int64(r[1]-r[0]) * c.BlockBytes
	var b cluster.PoolBlocks
	if size <= cluster.MaxInline {
		b.Inline = make([]byte, size)
		fill(r[0], b.Inline)
	} else {
		buf, err := n.stageBufs.get(n.tr, size)
		if err != nil {
			return nil, err
		}
		defer n.stageBufs.put(buf)
		fill(r[0], buf.mem[:size])
		key, closeWindow, err := buf.reg.Window(0, size)
		if err != nil {
			return nil, fmt.Errorf("exposing a put's blocks: %w", err)
		}
		defer closeWindow()
		b.Staged = &cluster.PoolStaged{Worker: n.tr.WorkerAddress(), Region: cluster.SpaceRegion{RKey: key, Addr: buf.reg.Addr(0), Size: size}}
	}
	var st []byte
	err := n.poolCall(node, func() (err error) {
		st, err = n.p.PoolPut(ctx, node, subCall(c, r), b, timeout)
		return err
	})
	return st, err
}

// DeletePoolAt implements store.PoolCluster.
func (n *Node) DeletePoolAt(ctx context.Context, node string, c store.PoolCall) (int, error) {
	total := 0
	for _, r := range poolSlices(c, false) {
		var k int
		err := n.poolCall(node, func() (err error) {
			k, err = n.p.PoolDelete(ctx, node, subCall(c, r))
			return err
		})
		if err != nil {
			return total, err
		}
		total += k
	}
	return total, nil
}

// poolErr makes the store's errors of a pool request from another node
// the control channel's: a pool this node does not have for the reader
// (its keys are absent here) wraps cluster.ErrNotFound.
func poolErr(err error) error {
	if err != nil && errors.Is(err, store.ErrNotFound) {
		return fmt.Errorf("%w: %v", cluster.ErrNotFound, err)
	}
	return err
}

// LookupPool implements cluster.PoolSource.
func (s source) LookupPool(c cluster.PoolCall) (int, error) {
	k, err := s.n.st.LookupPool(storeCall(c))
	return k, poolErr(err)
}

// PresentPool implements cluster.PoolSource.
func (s source) PresentPool(c cluster.PoolCall) ([]bool, error) {
	out, err := s.n.st.PresentPool(storeCall(c))
	return out, poolErr(err)
}

// GatherPool implements cluster.PoolSource: blocks of more than max bytes
// go into a staging buffer exposed through UCX until release.
func (s source) GatherPool(c cluster.PoolCall, max int64) ([]bool, []byte, cluster.SpaceExposure, func(), error) {
	n := s.n
	var (
		inline []byte
		buf    *stageBuf
	)
	found, err := n.st.GatherPool(storeCall(c), func(size int64) ([]byte, error) {
		if size <= max {
			inline = make([]byte, size)
			return inline, nil
		}
		var err error
		if buf, err = n.stageBufs.get(n.tr, size); err != nil {
			return nil, err
		}
		return buf.mem[:size], nil
	})
	if err != nil {
		if buf != nil {
			n.stageBufs.put(buf)
		}
		return nil, nil, cluster.SpaceExposure{}, nil, poolErr(err)
	}
	if buf == nil {
		return found, inline, cluster.SpaceExposure{}, nil, nil
	}
	size := int64(countTrue(found)) * c.Shape.BlockBytes
	key, closeWindow, err := buf.reg.Window(0, size)
	if err != nil {
		n.stageBufs.put(buf)
		return nil, nil, cluster.SpaceExposure{}, nil, err
	}
	n.kvStagedBytes.Add(uint64(size))
	var once sync.Once
	return found, nil, cluster.SpaceExposure{Worker: n.tr.WorkerAddress(), Regions: []cluster.SpaceRegion{{RKey: key, Addr: buf.reg.Addr(0), Size: size}}},
		func() {
			once.Do(func() {
				closeWindow()
				n.stageBufs.put(buf)
			})
		}, nil
}

// StorePool implements cluster.PoolSource: staged blocks are fetched from
// the putting node straight into the pool's blocks.
func (s source) StorePool(ctx context.Context, c cluster.PoolCall, b cluster.PoolBlocks) ([]byte, error) {
	n := s.n
	bb := c.Shape.BlockBytes
	st, err := n.st.StorePool(storeCall(c), func(dst [][]byte) error {
		if b.Staged == nil {
			for k, d := range dst {
				if d != nil {
					copy(d, b.Inline[int64(k)*bb:int64(k+1)*bb])
				}
			}
			return nil
		}
		return n.p.FetchPoolBlocks(ctx, b, bb, dst)
	})
	return st, poolErr(err)
}

// DeletePool implements cluster.PoolSource.
func (s source) DeletePool(c cluster.PoolCall) (int, error) {
	k, err := s.n.st.DeletePool(storeCall(c))
	return k, poolErr(err)
}

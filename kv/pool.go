package kv

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/protocol"
)

// Block pools (docs/kv.md, "Block pools"): a cache of KV blocks in the
// daemon's memory, by the engines' content hashes. A pool's block holds
// the layers [First, First+Count) of one block of a space, its parts laid
// end to end layer by layer (BlockBytes says how many bytes that is); Put
// stores blocks of a registered space, Lookup counts the present prefix of
// a key chain, Present says which keys are present one by one, Get copies
// blocks into a local space layer by layer.

// ErrMissing is a get's failure for keys the pool does not hold: their
// destination blocks are the BlockError's.
var ErrMissing = errors.New("kv: blocks not in the pool")

// BlockBytes returns the bytes of one block of layers [first,
// first+count) of l (count 0: every layer from first): the block size of a
// pool that holds them.
func (l *Layout) BlockBytes(first, count int) (int64, error) {
	if count == 0 {
		count = len(l.Layers) - first
	}
	if first < 0 || count <= 0 || first+count > len(l.Layers) {
		return 0, fmt.Errorf("%w: layers [%d, %d) of a space of %d layers", ErrMismatch, first, first+count, len(l.Layers))
	}
	var n int64
	for _, parts := range l.Layers[first : first+count] {
		for _, p := range parts {
			n += p.Bytes
		}
	}
	return n, nil
}

// Pool is a block pool as a client uses it: its name and, once a get
// needed it, a read-only mapping of its memory. Its methods are safe for
// concurrent use.
type Pool struct {
	c    *client.Client
	name string

	mu   sync.Mutex
	info client.PoolInfo
	mem  *client.PoolMemory // nil until the first Get
	old  []*client.PoolMemory
}

// CreatePool makes the pool name through c (client.CreatePool) and
// returns it.
func CreatePool(ctx context.Context, c *client.Client, name string, cfg client.PoolConfig) (*Pool, error) {
	info, err := c.CreatePool(ctx, name, cfg)
	if err != nil {
		return nil, err
	}
	return &Pool{c: c, name: name, info: info}, nil
}

// OpenPool returns the existing pool name (another uid's by UID:NAME, if
// it is shared).
func OpenPool(ctx context.Context, c *client.Client, name string) (*Pool, error) {
	info, err := c.StatPool(ctx, name)
	if err != nil {
		return nil, err
	}
	return &Pool{c: c, name: name, info: info}, nil
}

// Name returns the pool's name as it was opened.
func (p *Pool) Name() string { return p.name }

// Info returns what the pool was when it was made, opened, or last
// mapped; Stat asks the daemon.
func (p *Pool) Info() client.PoolInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.info
}

// Stat asks the daemon for the pool's counts.
func (p *Pool) Stat(ctx context.Context) (client.PoolInfo, error) {
	return p.c.StatPool(ctx, p.name)
}

// PutRequest is a put: block SrcBlocks[i] of the registered space Src,
// layers [First, First+Count) (Count 0: every layer from First), under
// Keys[i]. Timeout is, in a cluster-wide pool, how long the nodes owning
// keys have to store them (0: the daemon's default).
type PutRequest struct {
	Keys      [][]byte
	Src       *Desc
	SrcBlocks []int
	First     int
	Count     int
	Timeout   time.Duration
}

// Put stores the blocks of r in one round trip: the daemon copies them
// from the space's registered host memory (no copy in this process).
// Keys present already are left as they are (client.PutResult's Existed,
// and protocol.BlockExisted in Status). A block of other than the pool's
// BlockBytes is ErrMismatch, a block id out of the space ErrBlockRange.
func (p *Pool) Put(ctx context.Context, r PutRequest) (client.PutResult, error) {
	if r.Src == nil {
		return client.PutResult{}, fmt.Errorf("%w: a put needs a source description", ErrMismatch)
	}
	desc, err := r.Src.MarshalBinary() // validates
	if err != nil {
		return client.PutResult{}, err
	}
	count := r.Count
	if count == 0 {
		count = len(r.Src.Layers) - r.First
	}
	n, err := r.Src.BlockBytes(r.First, count)
	if err != nil {
		return client.PutResult{}, err
	}
	if info := p.Info(); n != info.BlockBytes {
		return client.PutResult{}, fmt.Errorf("%w: layers [%d, %d) of %s are %d bytes a block, the pool's blocks %d", ErrMismatch, r.First, r.First+count, r.Src.Name, n, info.BlockBytes)
	}
	if len(r.SrcBlocks) != len(r.Keys) {
		return client.PutResult{}, fmt.Errorf("%w: %d keys and %d source blocks", ErrMismatch, len(r.Keys), len(r.SrcBlocks))
	}
	src := client.BlockSource{Space: desc, Blocks: make([]uint32, len(r.SrcBlocks))}
	var bad []int
	for i, b := range r.SrcBlocks {
		if b < 0 || b >= r.Src.Blocks {
			bad = append(bad, b)
		}
		src.Blocks[i] = uint32(b)
	}
	if bad != nil {
		return client.PutResult{}, &BlockError{Space: r.Src.Name, Layer: r.First, Blocks: bad,
			Err: fmt.Errorf("%w: source block ids %v of a space of %d blocks", ErrBlockRange, bad, r.Src.Blocks)}
	}
	index := map[int]int{} // space region -> source region
	for l := r.First; l < r.First+count; l++ {
		for _, pt := range r.Src.Layers[l] {
			i, ok := index[pt.Region]
			if !ok {
				if r.Src.Regions[pt.Region].Device != "host" {
					return client.PutResult{}, fmt.Errorf("%w: region %d of %s is memory of %s: puts copy from host memory", ErrNotSupported, pt.Region, r.Src.Name, r.Src.Regions[pt.Region].Device)
				}
				i = len(src.Regions)
				index[pt.Region] = i
				src.Regions = append(src.Regions, r.Src.RegionName(pt.Region))
			}
			src.Parts = append(src.Parts, client.BlockPart{Region: i, Base: pt.Base, Stride: pt.Stride, Bytes: pt.Bytes})
		}
	}
	return p.c.PutBlocks(ctx, p.name, r.Keys, src, client.BlockPutOptions{Timeout: r.Timeout})
}

// Lookup returns how many of keys, from the first, the pool holds (the
// first absent key ends the prefix), in one round trip. With opts.Pin
// those blocks stay until a Get takes the pin over (GetRequest.Pin),
// Unpin, the pin's timeout or the end of c's connection.
func (p *Pool) Lookup(ctx context.Context, keys [][]byte, opts client.LookupOptions) (found int, pin uint64, err error) {
	return p.c.LookupBlocks(ctx, p.name, keys, opts)
}

// Present says which of keys the pool holds, each on its own (keys that
// are not a chain), in one round trip. With opts.Pin every key present
// stays until a Get takes the pin over, Unpin, the pin's timeout or the
// end of c's connection.
func (p *Pool) Present(ctx context.Context, keys [][]byte, opts client.LookupOptions) (client.Presence, error) {
	return p.c.LookupPresent(ctx, p.name, keys, opts)
}

// Unpin ends a lookup's pin that no Get took over.
func (p *Pool) Unpin(ctx context.Context, pin uint64) error { return p.c.UnpinBlocks(ctx, pin) }

// Delete removes keys from the pool and returns how many it held.
func (p *Pool) Delete(ctx context.Context, keys [][]byte) (int, error) {
	return p.c.DeleteBlocks(ctx, p.name, keys)
}

// Evict evicts up to n of the pool's least recently used blocks neither
// pinned nor being written, and returns how many it evicted.
func (p *Pool) Evict(ctx context.Context, n int) (int, error) { return p.c.EvictBlocks(ctx, p.name, n) }

// Close unmaps the pool's memory in this process (the pool stays in the
// daemon; client.DeletePool removes it). It is idempotent.
func (p *Pool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for _, m := range append(p.old, p.mem) {
		if m != nil {
			errs = append(errs, m.Close())
		}
	}
	p.mem, p.old = nil, nil
	return errors.Join(errs...)
}

// GetRequest is a get: the block of Keys[i] into block DstBlocks[i] of
// the local space Dst, layers [First, First+Count) (Count 0: every layer
// from First), which the pool's blocks hold. Pin, when not 0, is a pin of
// a Lookup on the same connection that the get takes over. Timeout is, in
// a cluster-wide pool, how long the nodes owning keys have to send their
// blocks (0: the daemon's default).
type GetRequest struct {
	Keys      [][]byte
	Dst       *Local
	DstBlocks []int
	First     int
	Count     int
	Pin       uint64
	Timeout   time.Duration
}

// Get finds and pins the blocks of r.Keys in one round trip, then, in the
// background, copies them out of the pool's memory into r.Dst layer by
// layer (Transfer.WaitLayer) and unpins them before the transfer is done
// (requests c sends after that find them unpinned). A key the pool does not
// hold fails the transfer at its end with a *BlockError naming its
// destination blocks, matching ErrMissing; the others are copied, and
// WaitLayer reports that error for every layer. Bad requests fail at once
// (ErrBlockRange, ErrMismatch, ErrNotSupported for GPU memory).
func (p *Pool) Get(ctx context.Context, r GetRequest) (*Transfer, error) {
	g, err := p.plan(r)
	if err != nil {
		return nil, err
	}
	l, err := p.c.GetBlocks(ctx, p.name, r.Keys, client.BlockGetOptions{Pin: r.Pin, Timeout: r.Timeout})
	if err != nil {
		return nil, err
	}
	unpin := func() {
		if l.Pin != 0 {
			// Sent before the transfer is done, not waited for: every later
			// request of this connection finds the blocks unpinned.
			_ = p.c.UnpinBlocksAsync(l.Pin)
		}
	}
	mem, err := p.memory(ctx, l.PoolID)
	if err != nil {
		unpin()
		return nil, err
	}
	t := &Transfer{first: g.first, layers: make([]chan struct{}, g.count), done: make(chan struct{})}
	for i := range t.layers {
		t.layers[i] = make(chan struct{})
	}
	var missing []int
	for i, s := range l.Slots {
		if s == protocol.NoSlot {
			missing = append(missing, r.DstBlocks[i])
		}
	}
	go func() {
		defer close(t.done)
		defer unpin()
		g.copyOut(mem, l.Slots, r.DstBlocks, t.layers, missing == nil)
		if missing != nil {
			err := fmt.Errorf("%w: %d of %d keys", ErrMissing, len(missing), len(r.Keys))
			if l.Unavailable > 0 {
				// The cause an engine acts on is the node: a retry may find it back.
				err = fmt.Errorf("%w: %w: %d of them because the nodes owning them did not answer (%s)",
					err, client.ErrUnavailable, l.Unavailable, l.Reason)
			}
			t.err = &BlockError{Space: p.name, Layer: g.first, Blocks: missing, Err: err}
		}
	}()
	return t, nil
}

// memory returns the pool's memory mapped, mapping it (again) when the
// pool's id is not the mapping's: the name was made again since.
func (p *Pool) memory(ctx context.Context, id uint64) (*client.PoolMemory, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mem != nil && p.mem.Info.ID == id {
		return p.mem, nil
	}
	m, err := p.c.MapPool(ctx, p.name)
	if err != nil {
		return nil, err
	}
	if m.Info.ID != id {
		m.Close()
		return nil, fmt.Errorf("%w: pool %s was made again during the get", ErrStale, p.name)
	}
	if p.mem != nil {
		// Transfers may still copy from the old mapping: it goes at Close.
		p.old = append(p.old, p.mem)
	}
	p.mem, p.info = m, m.Info
	return m, nil
}

// getPlan is a checked get: where each part of each layer lies in a pool
// block.
type getPlan struct {
	GetRequest
	first, count int
	off          [][]int64 // off[l-first][part]: the part's offset in a pool block
	blockBytes   int64
}

func (p *Pool) plan(r GetRequest) (*getPlan, error) {
	if r.Dst == nil {
		return nil, fmt.Errorf("%w: a get needs a destination", ErrMismatch)
	}
	if err := r.Dst.check(); err != nil {
		return nil, err
	}
	if len(r.DstBlocks) != len(r.Keys) || len(r.Keys) == 0 {
		return nil, fmt.Errorf("%w: %d keys and %d destination blocks: want as many, at least one", ErrMismatch, len(r.Keys), len(r.DstBlocks))
	}
	var bad []int
	for _, b := range r.DstBlocks {
		if b < 0 || b >= r.Dst.Blocks {
			bad = append(bad, b)
		}
	}
	if bad != nil {
		return nil, &BlockError{Space: p.name, Layer: r.First, Blocks: bad,
			Err: fmt.Errorf("%w: destination block ids %v of a space of %d blocks", ErrBlockRange, bad, r.Dst.Blocks)}
	}
	count := r.Count
	if count == 0 {
		count = len(r.Dst.Layers) - r.First
	}
	n, err := r.Dst.BlockBytes(r.First, count)
	if err != nil {
		return nil, err
	}
	if bb := p.Info().BlockBytes; n != bb {
		return nil, fmt.Errorf("%w: layers [%d, %d) of the destination are %d bytes a block, the pool's blocks %d", ErrMismatch, r.First, r.First+count, n, bb)
	}
	g := &getPlan{GetRequest: r, first: r.First, count: count, blockBytes: n}
	var off int64
	for l := r.First; l < r.First+count; l++ {
		o := make([]int64, len(r.Dst.Layers[l]))
		for i, pt := range r.Dst.Layers[l] {
			if m := r.Dst.Memory[pt.Region]; m.Device != nil {
				return nil, fmt.Errorf("%w: layer %d part %d is GPU memory: gets copy into host memory (the GPU tier is not built)", ErrNotSupported, l, i)
			}
			o[i] = off
			off += pt.Bytes
		}
		g.off = append(g.off, o)
	}
	return g, nil
}

// copyWorkerBytes is how many bytes a get copies per worker goroutine at
// least: below it one goroutine copies.
const copyWorkerBytes = 8 << 20

// copyOut copies every found block into the destination, layer by layer,
// closing layers[i] as layer first+i is complete when complete says so
// (no key is missing).
func (g *getPlan) copyOut(mem *client.PoolMemory, slots []uint32, dst []int, layers []chan struct{}, complete bool) {
	src := mem.Bytes()
	slot := mem.Info.SlotBytes
	var found []int
	for i, s := range slots {
		if s != protocol.NoSlot {
			found = append(found, i)
		}
	}
	// The workers split each layer's blocks, so that layers still complete
	// in order.
	workers := min(runtime.GOMAXPROCS(0), 8, int(int64(len(found))*g.blockBytes/copyWorkerBytes))
	for l := g.first; l < g.first+g.count; l++ {
		parts := g.Dst.Layers[l]
		one := func(i int) {
			from := int64(slots[i]) * slot
			for j, pt := range parts {
				d := g.Dst.Memory[pt.Region].Host
				do := pt.Base + int64(dst[i])*pt.Stride
				so := from + g.off[l-g.first][j]
				copy(d[do:do+pt.Bytes], src[so:so+pt.Bytes])
			}
		}
		if workers <= 1 {
			for _, i := range found {
				one(i)
			}
		} else {
			var wg sync.WaitGroup
			per := (len(found) + workers - 1) / workers
			for w := range workers {
				chunk := found[min(w*per, len(found)):min((w+1)*per, len(found))]
				wg.Go(func() {
					for _, i := range chunk {
						one(i)
					}
				})
			}
			wg.Wait()
		}
		if complete {
			close(layers[l-g.first])
		}
	}
}

package kv

import (
	"context"
	"fmt"
	"sync"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/protocol"
)

// Reads across nodes (docs/kv.md, "Across nodes"). A read whose source
// names another node goes through the reader's daemon: one kv_read request
// (client.ReadSpace) carries both descriptions, the block ids and the
// layers; the daemon has the source's daemon expose the regions the layers
// use and reads the bytes over the cluster's data plane straight into the
// destination, which must be a space registered with it, and reports each
// layer as it completes. Plan is the check and the copies both daemons
// agree on.

// Copy is one contiguous copy of a read between two described spaces: the
// Bytes bytes at Src of source region SrcRegion into Dst of destination
// region DstRegion.
type Copy struct {
	SrcRegion int
	Src       int64
	DstRegion int
	Dst       int64
	Bytes     int64
}

// Plan is a checked read of blocks of one described space into another, for
// layers [First, First+Count): what a daemon reading for a client runs.
type Plan struct {
	Src, Dst     *Desc
	First, Count int
	runs         []run
}

// NewPlan checks a read of srcBlocks of src into dstBlocks of dst (valid
// descriptions, as UnmarshalBinary returns them) for the layers [first,
// first+count) (count 0: every layer from first), with ReadBlocks's
// errors: a *BlockError matching ErrBlockRange for ids out of range,
// ErrMismatch for layouts that do not fit or layers out of range.
func NewPlan(src, dst *Desc, srcBlocks, dstBlocks []int, first, count int) (*Plan, error) {
	count, err := checkPairs(src.Name, &src.Layout, &dst.Layout, srcBlocks, dstBlocks, first, count)
	if err != nil {
		return nil, err
	}
	return &Plan{Src: src, Dst: dst, First: first, Count: count, runs: runs(srcBlocks, dstBlocks)}, nil
}

// Regions returns the regions of the source and of the destination the
// read's layers use, in ascending order.
func (p *Plan) Regions() (src, dst []int) {
	us, ud := make([]bool, len(p.Src.Regions)), make([]bool, len(p.Dst.Regions))
	for l := p.First; l < p.First+p.Count; l++ {
		for i, sp := range p.Src.Layers[l] {
			us[sp.Region], ud[p.Dst.Layers[l][i].Region] = true, true
		}
	}
	for i, u := range us {
		if u {
			src = append(src, i)
		}
	}
	for i, u := range ud {
		if u {
			dst = append(dst, i)
		}
	}
	return src, dst
}

// Layer returns layer l's copies, part by part, run by run: a run of blocks
// whose ids both ascend by one is one copy where both parts are contiguous
// (stride = bytes), one a block otherwise; a copy longer than max bytes
// (max > 0) is cut into pieces of at most max.
func (p *Plan) Layer(l int, max int64) []Copy {
	var out []Copy
	add := func(c Copy) {
		for max > 0 && c.Bytes > max {
			out = append(out, Copy{SrcRegion: c.SrcRegion, Src: c.Src, DstRegion: c.DstRegion, Dst: c.Dst, Bytes: max})
			c.Src, c.Dst, c.Bytes = c.Src+max, c.Dst+max, c.Bytes-max
		}
		out = append(out, c)
	}
	for i, sp := range p.Src.Layers[l] {
		dp := p.Dst.Layers[l][i]
		contiguous := sp.Stride == sp.Bytes && dp.Stride == dp.Bytes
		for _, r := range p.runs {
			so, do := sp.Base+int64(r.src)*sp.Stride, dp.Base+int64(r.dst)*dp.Stride
			if contiguous {
				add(Copy{SrcRegion: sp.Region, Src: so, DstRegion: dp.Region, Dst: do, Bytes: int64(r.n) * sp.Bytes})
				continue
			}
			for k := range int64(r.n) {
				add(Copy{SrcRegion: sp.Region, Src: so + k*sp.Stride, DstRegion: dp.Region, Dst: do + k*dp.Stride, Bytes: sp.Bytes})
			}
		}
	}
	return out
}

// remote reports whether a read of src through c crosses nodes: the space
// is on a node other than c's daemon's.
func remote(c *client.Client, src *Desc) bool {
	return src != nil && src.Node != "" && src.Node != c.Server().Node
}

// readRemote starts r, whose source is on another node, as kv_read
// requests: one, or as many as it takes to keep each within a message.
func readRemote(ctx context.Context, c *client.Client, r Request) (*Transfer, error) {
	if r.Dst == nil {
		return nil, fmt.Errorf("%w: a read needs a source description and a destination", ErrMismatch)
	}
	self := c.Server().Node
	if self == "" {
		return nil, fmt.Errorf("%w: space %s is on node %s, and this client's daemon is not part of a cluster", ErrNotSupported, r.Src.Name, r.Src.Node)
	}
	sp := r.Dst.space
	if sp == nil {
		return nil, fmt.Errorf("%w: a read from another node (%s) is written by this node's daemon, which must know the destination: register it (kv.Register)", ErrNotSupported, r.Src.Node)
	}
	src, err := r.Src.MarshalBinary()
	if err != nil {
		return nil, err
	}
	dst, err := sp.desc.MarshalBinary()
	if err != nil {
		return nil, err
	}
	if err := r.Dst.check(); err != nil {
		return nil, err
	}
	p, err := NewPlan(r.Src, &sp.desc, r.SrcBlocks, r.DstBlocks, r.First, r.Count)
	if err != nil {
		return nil, err
	}
	parts := splitPairs(r.SrcBlocks, r.DstBlocks, protocol.MaxMessageSize-len(src)-len(dst)-256)
	t := &Transfer{first: p.First, layers: make([]chan struct{}, p.Count), done: make(chan struct{})}
	for i := range t.layers {
		t.layers[i] = make(chan struct{})
	}
	pr := &remoteProgress{t: t, got: make([]int, len(parts))}
	errs := make([]error, len(parts))
	read := func(k int) {
		part := parts[k]
		read := client.SpaceRead{Src: src, Dst: dst, SrcBlocks: ids32(r.SrcBlocks[part.from:part.to]),
			DstBlocks: ids32(r.DstBlocks[part.from:part.to]), First: p.First, Count: p.Count}
		errs[k] = c.ReadSpace(ctx, read, func(layers int) { pr.set(k, layers) })
		if errs[k] == nil {
			pr.set(k, p.Count)
		}
	}
	go func() {
		defer close(t.done)
		// The first request on this goroutine, the others on their own.
		var wg sync.WaitGroup
		for k := 1; k < len(parts); k++ {
			wg.Go(func() { read(k) })
		}
		read(0)
		wg.Wait()
		t.err = pr.failure(r, parts, errs)
		if r.Notify != nil {
			// Through this client's daemon and the source's (kv_notify).
			tellSource(r.Src.Name, r.Notify, t.err, func(ctx context.Context, payload []byte) error {
				return c.NotifySpace(ctx, src, payload)
			})
		}
	}()
	return t, nil
}

// remoteProgress follows the layers each kv_read of a read has completed;
// a layer is complete once every one has it.
type remoteProgress struct {
	t    *Transfer
	mu   sync.Mutex
	got  []int // layers complete, by request
	done int   // layers whose channels are closed
}

// set records that request k has its first layers layers complete.
func (pr *remoteProgress) set(k, layers int) {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	pr.got[k] = max(pr.got[k], min(layers, len(pr.t.layers)))
	least := pr.got[0]
	for _, g := range pr.got {
		least = min(least, g)
	}
	for ; pr.done < least; pr.done++ {
		close(pr.t.layers[pr.done])
	}
}

// failure is the read's error: a *BlockError naming the destination blocks
// of the requests that failed, from the first layer one of them lacks.
func (pr *remoteProgress) failure(r Request, parts []pairRange, errs []error) error {
	var (
		blocks []int
		first  error
		layer  = -1
	)
	pr.mu.Lock()
	defer pr.mu.Unlock()
	for k, err := range errs {
		if err == nil {
			continue
		}
		if first == nil {
			first = err
		}
		blocks = append(blocks, r.DstBlocks[parts[k].from:parts[k].to]...)
		if l := pr.t.first + pr.got[k]; layer < 0 || l < layer {
			layer = l
		}
	}
	if first == nil {
		return nil
	}
	return &BlockError{Space: r.Src.Name, Layer: layer, Blocks: blocks, Err: first}
}

// pairRange is the pairs [from, to) of a read's block lists.
type pairRange struct{ from, to int }

// splitPairs cuts the pairs of a read into ranges whose ids take at most
// budget bytes of a kv_read request each (as protobuf varints).
func splitPairs(src, dst []int, budget int) []pairRange {
	var out []pairRange
	from, used := 0, 0
	for i := range src {
		n := protowire.SizeVarint(uint64(src[i])) + protowire.SizeVarint(uint64(dst[i]))
		if used+n > budget && i > from {
			out = append(out, pairRange{from, i})
			from, used = i, 0
		}
		used += n
	}
	return append(out, pairRange{from, len(src)})
}

func ids32(ids []int) []uint32 {
	out := make([]uint32, len(ids))
	for i, b := range ids {
		out[i] = uint32(b) // below MaxBlocks: checked
	}
	return out
}

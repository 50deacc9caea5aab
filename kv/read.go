package kv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/protocol"
)

// Errors of a read, matched with errors.Is. A read of a space that is gone
// (its engine ended or closed it) or unknown fails with client.ErrNotFound,
// one of another uid that did not share it with client.ErrNotFound or
// client.ErrPermission, inside a *BlockError.
var (
	// ErrBlockRange: a block id past the end of its space, or negative.
	ErrBlockRange = errors.New("kv: block id out of range")
	// ErrMismatch: the two spaces' layouts do not fit each other (layers,
	// parts, block bytes), or the request's lists do not.
	ErrMismatch = errors.New("kv: layouts do not match")
	// ErrInvalidRequest: a request field out of its bounds (Notify too
	// long).
	ErrInvalidRequest = errors.New("kv: invalid request")
	// ErrStale: the description names an earlier registration of the space.
	ErrStale = errors.New("kv: the space was registered again since this description")
	// ErrNotSupported: a read this version cannot do (between host and GPU
	// memory, or between two GPUs).
	ErrNotSupported = errors.New("kv: not supported")
)

// BlockError is a read's failure: Blocks are the destination block ids
// whose bytes are not (all) there, from layer Layer on.
type BlockError struct {
	Space  string
	Layer  int
	Blocks []int
	Err    error
}

func (e *BlockError) Error() string {
	return fmt.Sprintf("kv: reading %d blocks of %s failed from layer %d: %v", len(e.Blocks), e.Space, e.Layer, e.Err)
}

func (e *BlockError) Unwrap() error { return e.Err }

// Request is one vectored read: block SrcBlocks[i] of the registered space
// Src into block DstBlocks[i] of the local space Dst, for the layers
// [First, First+Count) (Count 0: every layer from First).
type Request struct {
	Src       *Desc
	SrcBlocks []int
	Dst       *Local
	DstBlocks []int
	First     int
	Count     int
	// Notify, when not nil, is sent to the source's engine when the read
	// ends, completed or failed (Space.TakeNotices there): at most
	// protocol.MaxNoticePayload-1 bytes, e.g. the request's id.
	Notify []byte
}

// run is a stretch of pairs whose source and destination ids both ascend
// by one.
type run struct{ src, dst, n int }

// runs coalesces the pairs (src[i], dst[i]) into runs, in order.
func runs(src, dst []int) []run {
	var out []run
	for i := range src {
		if k := len(out) - 1; k >= 0 && out[k].src+out[k].n == src[i] && out[k].dst+out[k].n == dst[i] {
			out[k].n++
			continue
		}
		out = append(out, run{src[i], dst[i], 1})
	}
	return out
}

// Transfer is a read in flight. Its methods are safe for concurrent use.
type Transfer struct {
	first  int
	layers []chan struct{} // closed when layer first+i is complete
	done   chan struct{}
	err    error // set before done is closed
}

// Done is closed when the read has ended, complete or failed.
func (t *Transfer) Done() <-chan struct{} { return t.done }

// Err returns the read's error once Done is closed (nil before, and on
// success).
func (t *Transfer) Err() error {
	select {
	case <-t.done:
		return t.err
	default:
		return nil
	}
}

// Wait waits for the read to end, as long as ctx allows, and returns its
// error. A Wait that gives up leaves the read running.
func (t *Transfer) Wait(ctx context.Context) error {
	select {
	case <-t.done:
		return t.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// WaitLayer waits until every requested block of layer l is in the
// destination (the engine may start that layer's attention), the read
// fails first, or ctx ends.
func (t *Transfer) WaitLayer(ctx context.Context, l int) error {
	if l < t.first || l >= t.first+len(t.layers) {
		return fmt.Errorf("%w: layer %d is not among the read's [%d, %d)", ErrMismatch, l, t.first, t.first+len(t.layers))
	}
	select {
	case <-t.layers[l-t.first]:
		return nil
	case <-t.done:
		select {
		case <-t.layers[l-t.first]:
			return nil
		default:
			return t.err
		}
	case <-ctx.Done():
		return ctx.Err()
	}
}

// ReadBlocks starts the read r through c: it checks the request, then,
// in the background, leases the source regions the layers need (so that
// their memory stays valid however the source ends), copies every layer's
// blocks (adjacent blocks coalesced into one copy; host memory by memmove,
// a GPU's memory into its own with one gather kernel launch a layer,
// cudaipc.Device.Gather), completing layer by layer, and releases the
// leases (which the source side sees in its
// regions' lease counts). A read whose source names another node goes
// through c's daemon instead (docs/kv.md, "Across nodes"): r.Dst must be
// registered with it (Register), and r has no Notify; host or GPU memory
// on either side; the Transfer is the same. Bad requests fail at once with ErrBlockRange,
// ErrMismatch, ErrInvalidDesc or ErrNotSupported; failures of the read
// itself come as a *BlockError from the Transfer.
func ReadBlocks(ctx context.Context, c *client.Client, r Request) (*Transfer, error) {
	if remote(c, r.Src) {
		return readRemote(ctx, c, r)
	}
	p, err := plan(r)
	if err != nil {
		return nil, err
	}
	t := &Transfer{first: p.first, layers: make([]chan struct{}, p.count), done: make(chan struct{})}
	for i := range t.layers {
		t.layers[i] = make(chan struct{})
	}
	go func() {
		defer close(t.done)
		t.err = p.read(ctx, c, t.layers)
		if r.Notify != nil {
			p.notify(c, t.err)
		}
	}()
	return t, nil
}

// notify tells the source's engine that the read ended (err: how), before
// the read's Done: a reader that exits once its read is done has sent it.
// The engine may be gone; that is logged, not the read's failure.
func (p *readPlan) notify(c *client.Client, err error) {
	tellSource(p.Src.Name, p.Notify, err, func(ctx context.Context, payload []byte) error {
		return c.Notify(ctx, p.Src.RegionName(0), payload)
	})
}

// tellSource sends the notice of a read of space that ended with err (its
// status byte, then payload) by send, within noticeTimeout; the engine may
// be gone, which is logged, not the read's failure.
func tellSource(space string, payload []byte, err error, send func(context.Context, []byte) error) {
	ctx, cancel := context.WithTimeout(context.Background(), noticeTimeout)
	defer cancel()
	if nerr := send(ctx, append([]byte{status(err)}, payload...)); nerr != nil {
		slog.Debug("kv: the source's engine was not told that a read ended", "space", space, "err", nerr)
	}
}

// status is a notice's status byte for a read that ended with err.
func status(err error) byte {
	if err != nil {
		return 1
	}
	return 0
}

// noticeTimeout bounds the notice at the end of a read.
const noticeTimeout = 5 * time.Second

// readPlan is a checked request.
type readPlan struct {
	Request
	desc         []byte // the source's description, as its regions must carry it
	first, count int
	runs         []run
	regions      []int           // the source regions the layers use
	gpu          *cudaipc.Device // the GPU of every region the read touches; nil: host memory
}

func plan(r Request) (*readPlan, error) {
	if r.Src == nil || r.Dst == nil {
		return nil, fmt.Errorf("%w: a read needs a source description and a destination", ErrMismatch)
	}
	desc, err := r.Src.MarshalBinary() // validates
	if err != nil {
		return nil, err
	}
	if err := r.Dst.check(); err != nil {
		return nil, err
	}
	if len(r.Notify) >= protocol.MaxNoticePayload {
		return nil, fmt.Errorf("%w: a notice of %d bytes (at most %d)", ErrInvalidRequest, len(r.Notify), protocol.MaxNoticePayload-1)
	}
	count, err := checkPairs(r.Src.Name, &r.Src.Layout, &r.Dst.Layout, r.SrcBlocks, r.DstBlocks, r.First, r.Count)
	if err != nil {
		return nil, err
	}
	p := &readPlan{Request: r, desc: desc, first: r.First, count: count, runs: runs(r.SrcBlocks, r.DstBlocks)}
	used := make([]bool, len(r.Src.Regions))
	for l := r.First; l < r.First+count; l++ {
		src, dst := r.Src.Layers[l], r.Dst.Layers[l]
		for i := range src {
			sdev, dm := r.Src.Regions[src[i].Region].Device, r.Dst.Memory[dst[i].Region]
			if l == r.First && i == 0 {
				p.gpu = dm.Device
			}
			if sdev != dm.device() || dm.Device != p.gpu {
				return nil, fmt.Errorf("%w: layer %d part %d: a read from %s memory into %s memory, in a read into %s memory (this version reads host memory into host memory, and a GPU's memory into its own)",
					ErrNotSupported, l, i, sdev, dm.device(), p.where())
			}
			used[src[i].Region] = true
		}
	}
	for i, u := range used {
		if u {
			p.regions = append(p.regions, i)
		}
	}
	return p, nil
}

// checkPairs checks a read's block lists against the two layouts (ids in
// range, as many of each) and its layers [first, first+count) (count 0:
// every layer from first), in which the layouts must fit each other: the
// same parts, of the same block bytes. It returns the count of layers.
func checkPairs(space string, src, dst *Layout, srcBlocks, dstBlocks []int, first, count int) (int, error) {
	if len(srcBlocks) != len(dstBlocks) || len(srcBlocks) == 0 {
		return 0, fmt.Errorf("%w: %d source and %d destination blocks: want as many, at least one", ErrMismatch, len(srcBlocks), len(dstBlocks))
	}
	for _, side := range []struct {
		name   string
		ids    []int
		blocks int
	}{{"source", srcBlocks, src.Blocks}, {"destination", dstBlocks, dst.Blocks}} {
		var bad []int
		for _, b := range side.ids {
			if b < 0 || b >= side.blocks {
				bad = append(bad, b)
			}
		}
		if bad != nil {
			return 0, &BlockError{Space: space, Layer: first, Blocks: bad,
				Err: fmt.Errorf("%w: %s block ids %s of a space of %d blocks", ErrBlockRange, side.name, idList(bad), side.blocks)}
		}
	}
	if count == 0 {
		count = len(src.Layers) - first
	}
	if first < 0 || count <= 0 || first+count > len(src.Layers) || len(src.Layers) != len(dst.Layers) {
		return 0, fmt.Errorf("%w: layers [%d, %d) of spaces of %d (source) and %d (destination) layers", ErrMismatch, first, first+count, len(src.Layers), len(dst.Layers))
	}
	for l := first; l < first+count; l++ {
		s, d := src.Layers[l], dst.Layers[l]
		if len(s) != len(d) {
			return 0, fmt.Errorf("%w: layer %d has %d parts in the source, %d in the destination", ErrMismatch, l, len(s), len(d))
		}
		for i := range s {
			if s[i].Bytes != d[i].Bytes {
				return 0, fmt.Errorf("%w: layer %d part %d: blocks of %d bytes in the source, %d in the destination", ErrMismatch, l, i, s[i].Bytes, d[i].Bytes)
			}
		}
	}
	return count, nil
}

// idList formats ids for an error message: the first few, and how many
// more.
func idList(ids []int) string {
	const shown = 16
	if len(ids) <= shown {
		return fmt.Sprint(ids)
	}
	return fmt.Sprintf("%v and %d more", ids[:shown], len(ids)-shown)
}

func (p *readPlan) where() string {
	if p.gpu == nil {
		return "host"
	}
	return p.gpu.UUID().String()
}

// read leases the source regions, copies layer by layer (closing
// layers[i] as layer first+i completes) and releases the leases.
func (p *readPlan) read(ctx context.Context, c *client.Client, layers []chan struct{}) (err error) {
	fail := func(layer int, err error) error {
		return &BlockError{Space: p.Src.Name, Layer: layer, Blocks: p.DstBlocks, Err: err}
	}
	// The regions' leases are asked for at once, and released at once:
	// their round trips overlap.
	leases := make([]*client.Lease, len(p.Src.Regions))
	errs := make([]error, len(p.Src.Regions))
	var wg sync.WaitGroup
	for _, i := range p.regions {
		wg.Go(func() { leases[i], errs[i] = lease(ctx, c, p.Src, i, p.desc) })
	}
	wg.Wait()
	defer func() {
		for _, i := range p.regions {
			if leases[i] != nil {
				wg.Go(func() { errs[i] = leases[i].Release() })
			}
		}
		wg.Wait()
		if rerr := errors.Join(errs...); rerr != nil && err == nil {
			err = fail(p.first+p.count, rerr)
		}
	}()
	if err := errors.Join(errs...); err != nil {
		clear(errs)
		return fail(p.first, err)
	}
	if p.gpu != nil {
		return p.gather(leases, layers, fail)
	}
	src := make([][]byte, len(p.Src.Regions))
	for _, i := range p.regions {
		src[i] = leases[i].Bytes()
	}
	for l := p.first; l < p.first+p.count; l++ {
		if err := ctx.Err(); err != nil {
			return fail(l, err)
		}
		for i, sp := range p.Src.Layers[l] {
			dp := p.Dst.Layers[l][i]
			s, d := src[sp.Region], p.Dst.Memory[dp.Region].Host
			contiguous := sp.Stride == sp.Bytes && dp.Stride == dp.Bytes
			for _, r := range p.runs {
				so, do := sp.Base+int64(r.src)*sp.Stride, dp.Base+int64(r.dst)*dp.Stride
				if contiguous {
					copy(d[do:do+int64(r.n)*dp.Bytes], s[so:so+int64(r.n)*sp.Bytes])
					continue
				}
				for k := range int64(r.n) {
					copy(d[do+k*dp.Stride:do+k*dp.Stride+dp.Bytes], s[so+k*sp.Stride:so+k*sp.Stride+sp.Bytes])
				}
			}
		}
		close(layers[l-p.first])
	}
	return nil
}

// gather copies on the GPU: one kernel launch a layer, each copying its
// layer's coalesced runs of blocks.
func (p *readPlan) gather(leases []*client.Lease, layers []chan struct{}, fail func(int, error) error) error {
	groups := make([][]cudaipc.Copy, p.count)
	for l := p.first; l < p.first+p.count; l++ {
		g := make([]cudaipc.Copy, 0, len(p.runs)*len(p.Src.Layers[l]))
		for i, sp := range p.Src.Layers[l] {
			dp := p.Dst.Layers[l][i]
			s, d := leases[sp.Region].Ptr(), p.Dst.Memory[dp.Region].Ptr
			contiguous := sp.Stride == sp.Bytes && dp.Stride == dp.Bytes
			for _, r := range p.runs {
				so, do := sp.Base+int64(r.src)*sp.Stride, dp.Base+int64(r.dst)*dp.Stride
				if contiguous {
					g = append(g, cudaipc.Copy{Dst: d + cudaipc.DevicePtr(do), Src: s + cudaipc.DevicePtr(so), Bytes: int64(r.n) * sp.Bytes})
					continue
				}
				for k := range int64(r.n) {
					g = append(g, cudaipc.Copy{Dst: d + cudaipc.DevicePtr(do+k*dp.Stride), Src: s + cudaipc.DevicePtr(so+k*sp.Stride), Bytes: sp.Bytes})
				}
			}
		}
		groups[l-p.first] = g
	}
	next := 0
	if err := p.gpu.Gather(groups, func(i int) { close(layers[i]); next = i + 1 }); err != nil {
		return fail(p.first+next, err)
	}
	return nil
}

// lease leases region i of the space d, whose encoding is desc, and checks
// that it is of that registration.
func lease(ctx context.Context, c *client.Client, d *Desc, i int, desc []byte) (*client.Lease, error) {
	name := d.RegionName(i)
	l, err := c.Get(ctx, name)
	if err != nil {
		if errors.Is(err, client.ErrNotFound) {
			return nil, fmt.Errorf("region %d (%s): %w (the space's engine ended or closed it, or it was never registered)", i, name, err)
		}
		return nil, fmt.Errorf("region %d (%s): %w", i, name, err)
	}
	if info := l.Info(); !bytes.Equal(info.Space, desc) || l.Size() != d.Regions[i].Size || l.Device() != d.Regions[i].Device {
		l.Release()
		return nil, fmt.Errorf("%w: region %d (%s) is not of the registration the description names", ErrStale, i, name)
	}
	return l, nil
}

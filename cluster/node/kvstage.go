package node

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"runtime"
	"slices"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/staging"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/kv"
	"github.com/cudaipc/cudaipc/store"
)

// Staged reads of KV spaces across nodes (docs/kv.md, "Across nodes"):
// where a read's copies are small (scattered blocks of tens of KiB), one
// transfer each costs UCX over tcp far more than the bytes, so the source's
// daemon gathers the read's blocks into one buffer (kv.Staging), layer by
// layer, exposed as a filling window, and the reader's daemon fetches it
// in pieces of stagePiece bytes, several in flight, and scatters each into
// the destination: two copies of memory in exchange for a few large
// transfers. A read is staged in groups of layers of at most maxStaged
// bytes, two groups under way at once.

const (
	// stagedBelow: a read whose copies average fewer bytes is staged.
	stagedBelow = 1 << 20
	// stagePiece is one fetch of a staged read.
	stagePiece = 4 << 20
	// stagedGroups is how many groups of a staged read are under way at
	// once: the next group's gathering overlaps the transfer of the last.
	stagedGroups = 2
	// stageIdle bounds the bytes of idle staging buffers a node keeps.
	stageIdle = 1 << 30
	// gatherInline: a staging of at most this many bytes is gathered
	// before the exposure is answered, rather than behind it.
	gatherInline = 1 << 20
	// minStageBuf is the smallest staging buffer: buffers are powers of
	// two from it, so that reads of nearby sizes share them.
	minStageBuf = 64 << 10
)

// maxStaged bounds one staged exposure (a group of layers); tests lower
// it (SetMaxStaged).
var maxStaged int64 = 256 << 20

// Space read modes, for tests (SetSpaceMode): by the copies' size, or
// always direct, or always staged.
const (
	spaceModeAuto = iota
	spaceModeDirect
	spaceModeStaged
)

// staged reports whether a read of p goes staged.
func (n *Node) staged(p *kv.Plan) bool {
	switch n.spaceMode.Load() {
	case spaceModeDirect:
		return false
	case spaceModeStaged:
		return true
	}
	var bytes, copies int64
	for l := p.First; l < p.First+p.Count; l++ {
		for _, c := range p.Layer(l, maxSpaceCopy) {
			bytes += c.Bytes
			copies++
		}
	}
	return bytes < stagedBelow*copies
}

// layerGroup is a group of layers of a staged read.
type layerGroup struct{ first, count int }

// stageGroups cuts the layers of p into groups whose staging is at most
// maxStaged bytes (a layer alone may be more).
func stageGroups(p *kv.Plan, n int) []layerGroup {
	var out []layerGroup
	g, size := layerGroup{first: p.First}, int64(0)
	for l := p.First; l < p.First+p.Count; l++ {
		var b int64
		for _, pt := range p.Src.Layers[l] {
			b += int64(n) * pt.Bytes
		}
		if g.count > 0 && size+b > maxStaged {
			out = append(out, g)
			g, size = layerGroup{first: l}, 0
		}
		g.count++
		size += b
	}
	return append(out, g)
}

// readStaged reads p staged: groups of layers, stagedGroups at once, each
// one exposure of the source's node gathered there and scattered here
// into dst (the destination regions' mappings; on GPU dev, or host memory
// when dev is nil), reporting layers in order
// as they complete.
func (n *Node) readStaged(ctx context.Context, r store.SpaceRead, src *kv.Desc, p *kv.Plan, srcIDs, dstIDs []int, dst []*spaceMap, dev *cudaipc.Device, progress func(int)) error {
	groups := stageGroups(p, len(srcIDs))
	var (
		mu       sync.Mutex
		pending  = make([]int64, p.Count) // bytes of each layer not scattered yet; -1 until its group is under way
		complete int
	)
	for i := range pending {
		pending[i] = -1
	}
	scattered := func(l int, b int64) {
		mu.Lock()
		defer mu.Unlock()
		pending[l-p.First] -= b
		k := complete
		for k < len(pending) && pending[k] == 0 {
			k++
		}
		if k > complete {
			complete = k
			if k < len(pending) { // the last layer is the read's end
				progress(k)
			}
		}
	}
	// start readies group g: its staging, its layers' sizes, the source
	// regions it reads.
	start := func(g layerGroup) (*kv.Staging, []int, error) {
		st, err := kv.NewStaging(&p.Dst.Layout, len(dstIDs), g.first, g.count)
		if err != nil {
			return nil, nil, err
		}
		mu.Lock()
		for l := g.first; l < g.first+g.count; l++ {
			_, size := st.Layer(l)
			pending[l-p.First] = size
		}
		mu.Unlock()
		var regions []int
		for l := g.first; l < g.first+g.count; l++ {
			for _, pt := range src.Layers[l] {
				regions = append(regions, pt.Region)
			}
		}
		slices.Sort(regions)
		return st, slices.Compact(regions), nil
	}
	if len(groups) == 1 { // a small read: on this goroutine
		st, regions, err := start(groups[0])
		if err != nil {
			return err
		}
		return n.readGroup(ctx, r, src, p, st, groups[0], regions, dstIDs, dst, dev, scattered)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sem := make(chan struct{}, stagedGroups)
	errs := make([]error, len(groups))
	var wg sync.WaitGroup
	for gi, g := range groups {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		st, regions, err := start(g)
		if err != nil {
			errs[gi] = err
			<-sem
			break
		}
		wg.Go(func() {
			defer func() { <-sem }()
			errs[gi] = n.readGroup(ctx, r, src, p, st, g, regions, dstIDs, dst, dev, scattered)
			if errs[gi] != nil {
				cancel()
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil && !errors.Is(err, context.Canceled) {
			return err
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return ctx.Err()
}

// pieceBufs are the buffers staged reads fetch pieces into.
var pieceBufs = sync.Pool{New: func() any { b := make([]byte, stagePiece); return &b }}

// readGroup reads one group of a staged read: it fetches the staging in
// pieces into buffers of its own and scatters each into dst (host memory
// by memmove; a GPU's with one gather kernel launch a piece, from pinned
// buffers the kernel reads across the bus); a staging of at most
// cluster.MaxInline bytes comes whole in the source's answer.
func (n *Node) readGroup(ctx context.Context, r store.SpaceRead, src *kv.Desc, p *kv.Plan, st *kv.Staging, g layerGroup, regions, dstIDs []int, dst []*spaceMap, dev *cudaipc.Device, scattered func(l int, b int64)) error {
	size := st.Size()
	read := cluster.SpaceRead{Node: src.Node, Reader: r.Reader, Desc: r.Src, Regions: regions, Sizes: []int64{size},
		Stage: &cluster.SpaceStage{Blocks: ints(r.SrcBlocks), First: g.first, Count: g.count}}
	if size <= cluster.MaxInline && dev == nil { // a small read into host memory: no closures, nothing kept
		b, err := n.p.GatherSpace(ctx, read)
		if err != nil {
			return err
		}
		st.Pieces(0, size, func(pc kv.Piece) {
			dp := p.Dst.Layers[pc.L][pc.P]
			d := dp.Base + int64(dstIDs[pc.K])*dp.Stride + pc.Skip
			copy(dst[dp.Region].mem[d:d+pc.Bytes], b[:pc.Bytes])
			b = b[pc.Bytes:]
			scattered(pc.L, pc.Bytes)
		})
		return nil
	}
	var (
		mu   sync.Mutex
		fail error // a failure of the GPU side, which the Gets cannot return
	)
	failed := func(err error) {
		mu.Lock()
		if fail == nil {
			fail = err
		}
		mu.Unlock()
	}
	// scatter puts b, bytes [off, off+len(b)) of the staging, in place;
	// on the GPU from ptr, where its kernels reach b.
	scatter := func(off int64, b []byte, ptr cudaipc.DevicePtr) {
		var copies []cudaipc.Copy
		at := off
		st.Pieces(off, int64(len(b)), func(pc kv.Piece) {
			dp := p.Dst.Layers[pc.L][pc.P]
			d := dp.Base + int64(dstIDs[pc.K])*dp.Stride + pc.Skip
			if dev == nil {
				copy(dst[dp.Region].mem[d:d+pc.Bytes], b[at-off:at-off+pc.Bytes])
			} else {
				copies = append(copies, cudaipc.Copy{Dst: dst[dp.Region].gpu.Ptr() + cudaipc.DevicePtr(d), Src: ptr + cudaipc.DevicePtr(at-off), Bytes: pc.Bytes})
			}
			at += pc.Bytes
		})
		if dev != nil {
			err := dev.Gather([][]cudaipc.Copy{copies}, nil)
			for _, m := range dst {
				if m != nil {
					runtime.KeepAlive(m.gpu)
				}
			}
			if err != nil {
				failed(fmt.Errorf("copy staged blocks to %s: %w", dev, err))
				return
			}
		}
		st.Pieces(off, int64(len(b)), func(pc kv.Piece) { scattered(pc.L, pc.Bytes) })
	}
	if size <= cluster.MaxInline {
		b, err := n.p.GatherSpace(ctx, read)
		if err != nil {
			return err
		}
		pc, err := n.gpuPieces.get(dev)
		if err != nil {
			return err
		}
		defer n.gpuPieces.put(pc)
		copy(pc.mem, b)
		scatter(0, pc.mem[:len(b)], pc.ptr)
		return fail
	}
	var (
		next   int64
		pieces = map[int]*gpuPiece{} // by Get tag, under mu
		tag    int
	)
	read.Next = func() (cluster.SpaceGet, bool) {
		if next >= size {
			return cluster.SpaceGet{}, false
		}
		m := min(stagePiece, size-next)
		get := cluster.SpaceGet{Region: 0, Off: next}
		if dev == nil {
			get.Dst = (*pieceBufs.Get().(*[]byte))[:m]
		} else {
			pc, err := n.gpuPieces.get(dev)
			if err != nil {
				failed(err)
				return cluster.SpaceGet{}, false
			}
			mu.Lock()
			tag++
			pieces[tag] = pc
			mu.Unlock()
			get.Dst, get.Tag = pc.mem[:m], tag
		}
		next += m
		return get, true
	}
	read.Done = func(get cluster.SpaceGet) {
		if dev == nil {
			scatter(get.Off, get.Dst, 0)
			b := get.Dst[:cap(get.Dst)]
			pieceBufs.Put(&b)
			return
		}
		mu.Lock()
		pc := pieces[get.Tag]
		delete(pieces, get.Tag)
		mu.Unlock()
		scatter(get.Off, get.Dst, pc.ptr)
		n.gpuPieces.put(pc)
	}
	err := n.p.ReadSpace(ctx, read)
	mu.Lock()
	defer mu.Unlock()
	for _, pc := range pieces { // Gets that failed
		n.gpuPieces.put(pc)
	}
	if err == nil {
		err = fail
	}
	return err
}

// gpuPiece is a piece buffer of a staged read into GPU memory: pinned
// host memory whose device's kernels reach it at ptr.
type gpuPiece struct {
	mem []byte
	reg *cudaipc.HostRegistration
	ptr cudaipc.DevicePtr
	dev *cudaipc.Device
}

// gpuPieces keeps idle GPU piece buffers, up to maxIdlePieces a device.
type gpuPieces struct {
	mu     sync.Mutex
	idle   map[*cudaipc.Device][]*gpuPiece
	closed bool
}

// maxIdlePieces bounds the idle GPU piece buffers a device keeps (of
// stagePiece bytes each).
const maxIdlePieces = 32

func (gp *gpuPieces) get(dev *cudaipc.Device) (*gpuPiece, error) {
	gp.mu.Lock()
	if l := gp.idle[dev]; len(l) > 0 {
		pc := l[len(l)-1]
		gp.idle[dev] = l[:len(l)-1]
		gp.mu.Unlock()
		return pc, nil
	}
	gp.mu.Unlock()
	mem, err := unix.Mmap(-1, 0, stagePiece, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("a piece buffer: %w", err)
	}
	staging.Populate(mem, 1)
	reg, ptr, err := dev.RegisterHostMapped(mem)
	if err != nil {
		unix.Munmap(mem)
		return nil, fmt.Errorf("register a piece buffer with %s: %w", dev, err)
	}
	return &gpuPiece{mem: mem, reg: reg, ptr: ptr, dev: dev}, nil
}

func (gp *gpuPieces) put(pc *gpuPiece) {
	gp.mu.Lock()
	if !gp.closed && len(gp.idle[pc.dev]) < maxIdlePieces {
		if gp.idle == nil {
			gp.idle = map[*cudaipc.Device][]*gpuPiece{}
		}
		gp.idle[pc.dev] = append(gp.idle[pc.dev], pc)
		gp.mu.Unlock()
		return
	}
	gp.mu.Unlock()
	pc.free()
}

func (pc *gpuPiece) free() {
	pc.reg.Unregister()
	unix.Munmap(pc.mem)
}

// close frees the idle buffers; those in use are freed when put back.
func (gp *gpuPieces) close() {
	gp.mu.Lock()
	idle := gp.idle
	gp.idle, gp.closed = nil, true
	gp.mu.Unlock()
	for _, l := range idle {
		for _, pc := range l {
			pc.free()
		}
	}
}

// stagedRegions checks stage against the space h.D and regions (those
// its layers use, held by h), returning the staging, each region's
// mapping by its number, and the GPU they are all on (nil: all host
// memory).
func stagedRegions(h *spaceHold, regions []int, stage *cluster.SpaceStage) (*kv.Staging, []*spaceMap, *cudaipc.Device, error) {
	d := h.D
	for _, b := range stage.Blocks {
		if b < 0 || b >= d.Blocks {
			return nil, nil, nil, fmt.Errorf("staging of block %d of a space of %d", b, d.Blocks)
		}
	}
	st, err := kv.NewStaging(&d.Layout, len(stage.Blocks), stage.First, stage.Count)
	if err != nil {
		return nil, nil, nil, err
	}
	if st.Size() > maxStaged {
		return nil, nil, nil, fmt.Errorf("a staging of %d bytes, at most %d: fewer layers a kvopen", st.Size(), maxStaged)
	}
	if !usesExactly(d, stage.First, stage.Count, regions) {
		return nil, nil, nil, fmt.Errorf("regions %v for a staging whose layers use others", regions)
	}
	maps := make([]*spaceMap, len(d.Regions))
	var dev *cudaipc.Device
	for k, m := range h.Maps {
		maps[regions[k]] = m
		if m.gpu != nil && k == 0 {
			dev = m.gpu.Device()
		}
		if (m.gpu == nil) != (dev == nil) || m.gpu != nil && m.gpu.Device() != dev {
			return nil, nil, nil, fmt.Errorf("%w: the regions a staging reads are on one GPU or all in host memory", errMixed)
		}
	}
	return st, maps, dev, nil
}

// usesExactly reports whether the layers [first, first+count) of d use
// exactly regions (ascending).
func usesExactly(d *kv.Desc, first, count int, regions []int) bool {
	if len(regions) == 1 { // the common case: no allocation
		for l := first; l < first+count; l++ {
			for _, pt := range d.Layers[l] {
				if pt.Region != regions[0] {
					return false
				}
			}
		}
		return true
	}
	var want []int
	for l := first; l < first+count; l++ {
		for _, pt := range d.Layers[l] {
			want = append(want, pt.Region)
		}
	}
	slices.Sort(want)
	return slices.Equal(slices.Compact(want), regions)
}

// errMixed: a read whose regions on one side are in different kinds of
// memory.
var errMixed = errors.New("mixed memory")

// gatherLayer copies the blocks of stage of layer l of d, host memory
// (its regions' mappings maps), where st lays them out in buf.
func gatherLayer(d *kv.Desc, st *kv.Staging, stage *cluster.SpaceStage, maps []*spaceMap, l int, buf []byte) {
	for pi, pt := range d.Layers[l] {
		for k, b := range stage.Blocks {
			off, m := st.Block(l, pi, k)
			s := pt.Base + int64(b)*pt.Stride
			copy(buf[off:off+m], maps[pt.Region].mem[s:s+m])
		}
	}
}

// gatherGPU copies the blocks of stage of d, GPU memory of dev (its
// regions' mappings maps), where st lays them out in host memory that
// dev's kernels reach at buf: one gather kernel launch a layer, layer(l)
// called as layer l is there.
func gatherGPU(dev *cudaipc.Device, d *kv.Desc, st *kv.Staging, stage *cluster.SpaceStage, maps []*spaceMap, buf cudaipc.DevicePtr, layer func(l int)) error {
	groups := make([][]cudaipc.Copy, stage.Count)
	for i := range groups {
		l := stage.First + i
		for pi, pt := range d.Layers[l] {
			src := maps[pt.Region].gpu.Ptr()
			for k, b := range stage.Blocks {
				off, m := st.Block(l, pi, k)
				groups[i] = append(groups[i], cudaipc.Copy{Dst: buf + cudaipc.DevicePtr(off), Src: src + cudaipc.DevicePtr(pt.Base+int64(b)*pt.Stride), Bytes: m})
			}
		}
	}
	err := dev.Gather(groups, func(i int) { layer(stage.First + i) })
	for _, m := range maps {
		if m != nil {
			runtime.KeepAlive(m.gpu)
		}
	}
	return err
}

// exposeStaged is ExposeSpace of a staged read: the regions h holds (of
// the space h.D), gathered into a staging buffer of the node's pool
// layer by layer (by a goroutine of its own, but for a small staging of
// host memory), exposed as a filling window. GPU memory is gathered by
// the device straight into the buffer, mapped for it. release stops the
// gathering and gives the buffer back; the caller then lets h go.
func (n *Node) exposeStaged(h *spaceHold, regions []int, stage *cluster.SpaceStage) (cluster.SpaceExposure, func(), error) {
	d := h.D
	st, maps, dev, err := stagedRegions(h, regions, stage)
	if err != nil {
		return cluster.SpaceExposure{}, nil, err
	}
	buf, err := n.stageBufs.get(n.tr, st.Size())
	if err != nil {
		return cluster.SpaceExposure{}, nil, err
	}
	var devPtr cudaipc.DevicePtr
	if dev != nil {
		if devPtr, err = buf.mapFor(dev); err != nil {
			n.stageBufs.put(buf)
			return cluster.SpaceExposure{}, nil, err
		}
	}
	fw, err := buf.reg.FillingWindow(0, st.Size())
	if err != nil {
		n.stageBufs.put(buf)
		return cluster.SpaceExposure{}, nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	ready := func(l int) {
		off, m := st.Layer(l)
		fw.Ready(off + m)
		n.kvStagedBytes.Add(uint64(m))
	}
	gather := func() {
		if dev != nil {
			if err := gatherGPU(dev, d, st, stage, maps, devPtr, ready); err != nil {
				// The reader's fetches of what is not there are refused.
				fw.Close()
				n.log.Warn("KV read: gathering GPU blocks failed", "space", d.Name, "err", err)
			}
			return
		}
		for l := stage.First; l < stage.First+stage.Count; l++ {
			if ctx.Err() != nil {
				return
			}
			gatherLayer(d, st, stage, maps, l, buf.mem)
			ready(l)
		}
	}
	gathered := make(chan struct{})
	if dev == nil && st.Size() <= gatherInline {
		// Before the answer: the reader's first fetch finds it ready.
		gather()
		close(gathered)
	} else {
		go func() {
			defer close(gathered)
			gather()
		}()
	}
	var once sync.Once
	return cluster.SpaceExposure{Worker: n.tr.WorkerAddress(), Regions: []cluster.SpaceRegion{{RKey: fw.Key, Addr: buf.reg.Addr(0), Size: st.Size()}}},
		func() {
			once.Do(func() {
				cancel()
				<-gathered
				fw.Close()
				n.stageBufs.put(buf)
			})
		}, nil
}

// GatherSpace implements cluster.SpaceGatherer: a small staged read's
// bytes, gathered for the answer.
func (s source) GatherSpace(reader uint32, desc []byte, regions []int, stage *cluster.SpaceStage, max int64, dst []byte) ([]byte, error) {
	n := s.n
	h, err := n.holdSpace(reader, desc, regions, nil)
	if err != nil {
		return nil, err
	}
	defer h.release()
	d := h.D
	st, maps, dev, err := stagedRegions(h, regions, stage)
	if err != nil {
		return nil, err
	}
	if st.Size() > max {
		return nil, fmt.Errorf("a staging of %d bytes, at most %d inline", st.Size(), max)
	}
	at := len(dst)
	dst = slices.Grow(dst, int(st.Size()))[:at+int(st.Size())]
	out := dst[at:]
	if dev != nil {
		buf, err := n.stageBufs.get(n.tr, st.Size())
		if err != nil {
			return nil, err
		}
		defer n.stageBufs.put(buf)
		ptr, err := buf.mapFor(dev)
		if err != nil {
			return nil, err
		}
		if err := gatherGPU(dev, d, st, stage, maps, ptr, func(int) {}); err != nil {
			return nil, fmt.Errorf("gather GPU blocks: %w", err)
		}
		copy(out, buf.mem)
	} else {
		for l := stage.First; l < stage.First+stage.Count; l++ {
			gatherLayer(d, st, stage, maps, l, out)
		}
	}
	n.kvStagedBytes.Add(uint64(len(out)))
	n.exposures.Add(1)
	return dst, nil
}

// stageBuf is a staging buffer of host memory, registered with UCX once
// for its life, and mapped for the GPUs that gathered into it.
type stageBuf struct {
	mem    []byte
	reg    *ucxtransport.Region
	mapped map[*cudaipc.Device]mappedHost
}

// mappedHost is host memory registered with a GPU's driver for its
// kernels, at ptr.
type mappedHost struct {
	reg *cudaipc.HostRegistration
	ptr cudaipc.DevicePtr
}

// mapFor returns the address at which dev's kernels reach b, registering
// it the first time.
func (b *stageBuf) mapFor(dev *cudaipc.Device) (cudaipc.DevicePtr, error) {
	if m, ok := b.mapped[dev]; ok {
		return m.ptr, nil
	}
	reg, ptr, err := dev.RegisterHostMapped(b.mem)
	if err != nil {
		return 0, fmt.Errorf("register a staging buffer with %s: %w", dev, err)
	}
	if b.mapped == nil {
		b.mapped = map[*cudaipc.Device]mappedHost{}
	}
	b.mapped[dev] = mappedHost{reg, ptr}
	return ptr, nil
}

func (b *stageBuf) free() {
	for _, m := range b.mapped {
		m.reg.Unregister()
	}
	b.reg.Close()
	unix.Munmap(b.mem)
}

// stageBufs keeps idle staging buffers by size (powers of two), at most
// stageIdle bytes of them.
type stageBufs struct {
	mu     sync.Mutex
	idle   map[int64][]*stageBuf
	bytes  int64
	closed bool
}

// get returns a buffer of at least size bytes: an idle one, or a new one
// registered with tr.
func (sb *stageBufs) get(tr *ucxtransport.Transport, size int64) (*stageBuf, error) {
	c := int64(minStageBuf)
	if size > c {
		c = 1 << bits.Len64(uint64(size-1))
	}
	sb.mu.Lock()
	if l := sb.idle[c]; len(l) > 0 {
		b := l[len(l)-1]
		sb.idle[c] = l[:len(l)-1]
		sb.bytes -= c
		sb.mu.Unlock()
		return b, nil
	}
	sb.mu.Unlock()
	mem, err := unix.Mmap(-1, 0, int(c), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("a staging buffer of %d bytes: %w", c, err)
	}
	staging.Populate(mem, 0)
	reg, err := tr.Register(mem)
	if err != nil {
		unix.Munmap(mem)
		return nil, fmt.Errorf("register a staging buffer with UCX: %w", err)
	}
	return &stageBuf{mem: mem, reg: reg}, nil
}

// put gives b back, freeing it beyond the bound.
func (sb *stageBufs) put(b *stageBuf) {
	c := int64(len(b.mem))
	sb.mu.Lock()
	if sb.closed || sb.bytes+c > stageIdle {
		sb.mu.Unlock()
		b.free()
		return
	}
	if sb.idle == nil {
		sb.idle = map[int64][]*stageBuf{}
	}
	sb.idle[c] = append(sb.idle[c], b)
	sb.bytes += c
	sb.mu.Unlock()
}

// close frees the idle buffers; those in use are freed when put back.
func (sb *stageBufs) close() {
	sb.mu.Lock()
	idle := sb.idle
	sb.idle, sb.bytes, sb.closed = nil, 0, true
	sb.mu.Unlock()
	for _, l := range idle {
		for _, b := range l {
			b.free()
		}
	}
}

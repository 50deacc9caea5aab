package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/kv"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
	"github.com/cudaipc/cudaipc/store"
)

// KV spaces across nodes (docs/kv.md, "Across nodes"). On the reader's
// node, ReadSpace serves a client's kv_read: it maps the destination
// space the client's uid registered here (holdRegions), has the source's
// node expose the regions the read uses (cluster.Puller.ReadSpace) and
// reads each copy of the plan (kv.Plan) straight into the mapping,
// reporting layers as they complete. On the source's node, ExposeSpace
// maps the regions for the reader's uid (the store's rules: its owner,
// root, anyone when registered shared) and exposes them through UCX.
//
// Both sides keep a registration's memory mapped (and, on the source,
// registered with UCX) from its first read until the registration ends:
// spaceMaps, swept every spaceSweep; and a uid's first read of a space
// leases its regions, the next only check that they are still registered
// (kvhold.go).

// maxSpaceCopy bounds one Get of a space read: a longer copy (a run of
// contiguous blocks) is cut, so that its pieces go in flight side by side.
const maxSpaceCopy = 4 << 20

// spaceSweep is how often the maps of registrations that ended are dropped.
const spaceSweep = 2 * time.Second

// NodeName implements store.SpaceReader: the node's name in the cluster.
func (n *Node) NodeName() string { return n.cfg.Directory.Node }

// invalid is a kv_read's request error (code INVALID).
func invalid(format string, a ...any) error {
	return protocol.Errorf(storev1.Error_INVALID, "kv_read: "+format, a...)
}

// ReadSpace implements store.SpaceReader.
func (n *Node) ReadSpace(ctx context.Context, r store.SpaceRead, progress func(layers int)) (int, error) {
	p, err := n.readSpace(ctx, r, progress)
	if err != nil {
		n.kvReadsFailed.Add(1)
		return 0, err
	}
	n.kvReads.Add(1)
	for l := p.First; l < p.First+p.Count; l++ {
		for _, pt := range p.Src.Layers[l] {
			n.kvReadBytes.Add(uint64(pt.Bytes) * uint64(len(r.SrcBlocks)))
		}
	}
	return p.Count, nil
}

// readSpace is ReadSpace, returning the read's plan.
func (n *Node) readSpace(ctx context.Context, r store.SpaceRead, progress func(layers int)) (*kv.Plan, error) {
	src, err := n.descs.parse(r.Src)
	if err != nil {
		return nil, invalid("source: %v", err)
	}
	dst, err := n.descs.parse(r.Dst)
	if err != nil {
		return nil, invalid("destination: %v", err)
	}
	self := n.cfg.Directory.Node
	if src.Node == "" || src.Node == self {
		return nil, invalid("space %s is on this node (%q), not another: read it directly", src.Name, src.Node)
	}
	if dst.Node != self {
		return nil, invalid("destination %s is on node %q, not this one (%s)", dst.Name, dst.Node, self)
	}
	if uid, _, ok := protocol.SplitOwner(dst.Name); !ok || uid != r.Reader {
		return nil, protocol.Errorf(storev1.Error_PERMISSION, "kv_read: destination %s is not a space of uid %d: a read writes only into the reader's own", dst.Name, r.Reader)
	}
	p, err := kv.NewPlan(src, dst, ints(r.SrcBlocks), ints(r.DstBlocks), r.First, r.Count)
	if err != nil {
		return nil, invalid("%v", err)
	}
	srcRegions, dstRegions := p.Regions()
	gpu := false
	for _, i := range srcRegions {
		gpu = gpu || src.Regions[i].Device != "host"
	}
	for _, i := range dstRegions {
		gpu = gpu || dst.Regions[i].Device != "host"
	}
	hold, err := n.holdRegions(r.Reader, r.Dst, dstRegions, true, nil, func(d *kv.Desc, i int, reg *store.Registered) error {
		switch {
		case reg.Owner != r.Reader:
			return protocol.Errorf(storev1.Error_PERMISSION, "kv_read: destination region %s is uid %d's, not the reader's (%d)", reg.Name, reg.Owner, r.Reader)
		case !bytes.Equal(reg.Space, r.Dst) || reg.Device != d.Regions[i].Device || reg.Size != d.Regions[i].Size || reg.Device == "host" && len(reg.Files) != 1:
			return fmt.Errorf("destination region %s is not of the registration the description names (registered again since?): %w", reg.Name, store.ErrNotFound)
		}
		return nil
	})
	if err != nil {
		if errors.As(err, new(mapError)) {
			return nil, invalid("destination %s: %v", dst.Name, err)
		}
		return nil, fmt.Errorf("destination %s: %w", dst.Name, err)
	}
	defer hold.release()
	maps := make([]*spaceMap, len(dst.Regions))
	mem := make([][]byte, len(dst.Regions)) // host memory's, for direct reads
	var dev *cudaipc.Device
	for k, m := range hold.Maps {
		i := dstRegions[k]
		maps[i], mem[i] = m, m.mem
		if m.gpu != nil && dev == nil {
			dev = m.gpu.Device()
		}
		if (m.gpu == nil) != (dev == nil) || m.gpu != nil && m.gpu.Device() != dev {
			return nil, invalid("destination %s: the regions a read writes are on one GPU or all in host memory", dst.Name)
		}
	}
	if gpu || n.staged(p) {
		return p, n.readStaged(ctx, r, src, p, ints(r.SrcBlocks), ints(r.DstBlocks), maps, dev, progress)
	}
	index := make(map[int]int, len(srcRegions))
	sizes := make([]int64, len(srcRegions))
	for k, i := range srcRegions {
		index[i], sizes[k] = k, src.Regions[i].Size
	}
	lr := &layerReads{p: p, progress: progress, pending: make([]int, p.Count), index: index, dst: mem, l: p.First}
	for i := range lr.pending {
		lr.pending[i] = -1
	}
	return p, n.p.ReadSpace(ctx, cluster.SpaceRead{Node: src.Node, Reader: r.Reader, Desc: r.Src, Regions: srcRegions, Sizes: sizes,
		Next: lr.next, Done: lr.done})
}

// layerReads hands out a plan's copies layer by layer as Gets (their Tag
// the layer) and reports layers as all their Gets are done.
type layerReads struct {
	p        *kv.Plan
	progress func(int)
	index    map[int]int // source region → its index in the exposure
	dst      [][]byte    // destination regions' mappings
	// next's state (cluster.SpaceRead calls it one at a time): the layer
	// handed out, its copies, the next of them.
	l      int
	copies []kv.Copy
	k      int

	mu       sync.Mutex
	pending  []int // Gets not done, by layer from First; -1 until handed out
	complete int   // layers reported complete
}

func (lr *layerReads) next() (cluster.SpaceGet, bool) {
	for lr.k == len(lr.copies) {
		if lr.copies != nil {
			lr.l++
		}
		if lr.l >= lr.p.First+lr.p.Count {
			return cluster.SpaceGet{}, false
		}
		lr.copies, lr.k = lr.p.Layer(lr.l, maxSpaceCopy), 0
		lr.mu.Lock()
		lr.pending[lr.l-lr.p.First] = len(lr.copies)
		lr.mu.Unlock()
	}
	c := lr.copies[lr.k]
	lr.k++
	return cluster.SpaceGet{Region: lr.index[c.SrcRegion], Off: c.Src, Dst: lr.dst[c.DstRegion][c.Dst : c.Dst+c.Bytes], Tag: lr.l}, true
}

func (lr *layerReads) done(g cluster.SpaceGet) {
	lr.mu.Lock()
	defer lr.mu.Unlock()
	lr.pending[g.Tag-lr.p.First]--
	n := lr.complete
	for n < len(lr.pending) && lr.pending[n] == 0 {
		n++
	}
	if n > lr.complete {
		lr.complete = n
		// Under lr.mu: progress is reported in order, from one goroutine
		// at a time. The last layer is the read's end.
		if n < len(lr.pending) {
			lr.progress(n)
		}
	}
}

func ints(ids []uint32) []int {
	out := make([]int, len(ids))
	for i, b := range ids {
		out[i] = int(b)
	}
	return out
}

// ExposeSpace implements cluster.SpaceSource: regions of a space
// registered on this node, held for the reader's uid, exposed through
// UCX windows on their mappings until release.
func (s source) ExposeSpace(reader uint32, desc []byte, regions []int, stage *cluster.SpaceStage) (cluster.SpaceExposure, func(), error) {
	n := s.n
	var register func([]byte) (*ucxtransport.Region, error)
	if stage == nil {
		register = n.tr.Register
	}
	h, err := n.holdSpace(reader, desc, regions, register)
	if err != nil {
		return cluster.SpaceExposure{}, nil, err
	}
	if stage != nil {
		e, rel, err := n.exposeStaged(h, regions, stage)
		if err != nil {
			h.release()
			return e, nil, err
		}
		n.exposures.Add(1)
		var once sync.Once
		return e, func() { once.Do(func() { rel(); h.release() }) }, nil
	}
	undo := []func(){h.release}
	release := func() {
		for _, u := range slices.Backward(undo) {
			u()
		}
	}
	e := cluster.SpaceExposure{Worker: n.tr.WorkerAddress()}
	for k, reg := range h.Regs {
		m := h.Maps[k]
		key, closeWindow, err := m.reg.Window(0, reg.Size)
		if err != nil {
			release()
			return cluster.SpaceExposure{}, nil, fmt.Errorf("region %s: %w", reg.Name, err)
		}
		undo = append(undo, closeWindow)
		e.Regions = append(e.Regions, cluster.SpaceRegion{RKey: key, Addr: m.reg.Addr(0), Size: reg.Size})
		n.exposedBytes.Add(uint64(reg.Size))
	}
	n.exposures.Add(1)
	var once sync.Once
	return e, func() { once.Do(release) }, nil
}

// NotifySpace implements store.SpaceReader: a reader's notice for the
// engine of a space of another node, sent to that node.
func (n *Node) NotifySpace(ctx context.Context, reader uint32, space, payload []byte) error {
	var d kv.Desc
	if err := d.UnmarshalBinary(space); err != nil {
		return protocol.Errorf(storev1.Error_INVALID, "kv_notify: %v", err)
	}
	if d.Node == "" || d.Node == n.cfg.Directory.Node {
		return protocol.Errorf(storev1.Error_INVALID, "kv_notify: space %s is on this node (%q), not another: notify it directly", d.Name, d.Node)
	}
	return n.p.NotifySpace(ctx, d.Node, reader, space, payload)
}

// NotifySpace implements cluster.SpaceNotifier: a notice from a reader on
// another node, queued for the engine of a space of this one (its first
// region's registration).
func (s source) NotifySpace(reader uint32, desc, payload []byte) error {
	n := s.n
	var d kv.Desc
	if err := d.UnmarshalBinary(desc); err != nil {
		return err
	}
	if self := n.cfg.Directory.Node; d.Node != self {
		return fmt.Errorf("%w: space %s is on node %q, not this one", cluster.ErrNoSpace, d.Name, d.Node)
	}
	if err := n.st.Notify(reader, d.RegionName(0), payload); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			err = fmt.Errorf("%w: %v", cluster.ErrNoSpace, err)
		}
		return err
	}
	return nil
}

// holdSpace maps, for uid reader, the regions of the space of this node
// whose description is desc (registered with UCX by register when set),
// checking that they are of that registration: a space that is not here
// for the reader fails it with an error wrapping cluster.ErrNoSpace.
func (n *Node) holdSpace(reader uint32, desc []byte, regions []int, register func([]byte) (*ucxtransport.Region, error)) (*spaceHold, error) {
	d, err := n.descs.parse(desc)
	if err != nil {
		return nil, err
	}
	if self := n.cfg.Directory.Node; d.Node != self {
		return nil, fmt.Errorf("%w: space %s is on node %q, not this one", cluster.ErrNoSpace, d.Name, d.Node)
	}
	h, err := n.holdRegions(reader, desc, regions, false, register, func(d *kv.Desc, i int, reg *store.Registered) error {
		if !bytes.Equal(reg.Space, desc) || reg.Device != d.Regions[i].Device || reg.Size != d.Regions[i].Size || reg.Device == "host" && len(reg.Files) != 1 {
			return fmt.Errorf("%w: region %s is not of the registration the description names (registered again since)", cluster.ErrNoSpace, reg.Name)
		}
		return nil
	})
	if errors.Is(err, store.ErrNotFound) && !errors.Is(err, cluster.ErrNoSpace) {
		err = fmt.Errorf("%w: %v (its engine ended or closed it, or it was never registered, or not for this uid)", cluster.ErrNoSpace, err)
	}
	return h, err
}

// spaceMaps are registrations' memory mapped into the daemon for reads
// across nodes, kept from their first read until the registration ends.
type spaceMaps struct {
	mu sync.Mutex
	m  map[spaceKey]*spaceMap
}

// spaceKey names a mapping: a registration, mapped for reading (a source,
// registered with UCX) or for writing (a destination).
type spaceKey struct {
	reg   store.Registration
	write bool
}

// spaceMap is one mapping, of host memory (mem) or of GPU memory (gpu);
// users count the reads using it.
type spaceMap struct {
	key   spaceKey
	mem   []byte
	gpu   *cudaipc.Mapping
	reg   *ucxtransport.Region // a source's registration with UCX
	users int
	gone  bool // out of the cache: the last user unmaps it
}

// acquire returns reg's mapping (read-write with write), mapping it (and,
// with register, registering it) the first time, with one more user.
func (sm *spaceMaps) acquire(reg *store.Registered, write bool, register func([]byte) (*ucxtransport.Region, error)) (*spaceMap, error) {
	key := spaceKey{reg.Registration, write}
	sm.mu.Lock()
	defer sm.mu.Unlock()
	if m := sm.m[key]; m != nil {
		if m.reg == nil && register != nil {
			var err error
			if m.reg, err = register(m.mem); err != nil {
				return nil, fmt.Errorf("register with UCX: %w", err)
			}
		}
		m.users++
		return m, nil
	}
	m := &spaceMap{key: key, users: 1}
	if reg.Device != "host" {
		if register != nil {
			return nil, fmt.Errorf("GPU memory is staged, not registered with UCX")
		}
		if err := m.importGPU(reg, write); err != nil {
			return nil, err
		}
		if sm.m == nil {
			sm.m = map[spaceKey]*spaceMap{}
		}
		sm.m[key] = m
		return m, nil
	}
	prot := unix.PROT_READ
	if write {
		prot |= unix.PROT_WRITE
	}
	mem, err := unix.Mmap(int(reg.Files[0].Fd()), 0, int(reg.Size), prot, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("map the registered memory: %w", err)
	}
	m.mem = mem
	if register != nil {
		if m.reg, err = register(mem); err != nil {
			unix.Munmap(mem)
			return nil, fmt.Errorf("register with UCX: %w", err)
		}
	}
	if sm.m == nil {
		sm.m = map[spaceKey]*spaceMap{}
	}
	sm.m[key] = m
	return m, nil
}

// mapped returns reg's mapping (read-write with write), with one more
// user, when it is mapped already (and, with register, registered or
// registered now); nil when it is not.
func (sm *spaceMaps) mapped(reg *store.Registered, write bool, register func([]byte) (*ucxtransport.Region, error)) *spaceMap {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	m := sm.m[spaceKey{reg.Registration, write}]
	if m == nil {
		return nil
	}
	if m.reg == nil && register != nil {
		if m.gpu != nil {
			return nil
		}
		var err error
		if m.reg, err = register(m.mem); err != nil {
			return nil
		}
	}
	m.users++
	return m
}

// release lets go of m.
func (sm *spaceMaps) release(m *spaceMap) {
	sm.mu.Lock()
	m.users--
	last := m.gone && m.users == 0
	sm.mu.Unlock()
	if last {
		m.close()
	}
}

// importGPU maps reg, GPU memory (a vmm-fd region and its descriptors,
// or a cuda-ipc one), into the daemon, read-only unless write.
func (m *spaceMap) importGPU(reg *store.Registered, write bool) error {
	r, err := cudaipc.DecodeRegion(reg.Region)
	if err != nil {
		return fmt.Errorf("registered GPU memory's region: %w", err)
	}
	access := cudaipc.ReadOnly
	if write {
		access = cudaipc.ReadWrite
	}
	m.gpu, err = cudaipc.Import(r, cudaipc.WithFiles(reg.Files...), cudaipc.WithAccess(access))
	if err != nil {
		return fmt.Errorf("map registered GPU memory: %w", err)
	}
	return nil
}

func (m *spaceMap) close() {
	if m.reg != nil {
		m.reg.Close() // waits for replies under way
	}
	if m.gpu != nil {
		m.gpu.Close()
		return
	}
	unix.Munmap(m.mem)
}

// sweep drops the mappings of registrations that ended (live says which
// have not); those in use go with their last user.
func (sm *spaceMaps) sweep(live func(store.Registration) bool) {
	sm.mu.Lock()
	var closing []*spaceMap
	for k, m := range sm.m {
		if !live(k.reg) {
			m.gone = true
			delete(sm.m, k)
			if m.users == 0 {
				closing = append(closing, m)
			}
		}
	}
	sm.mu.Unlock()
	for _, m := range closing {
		m.close()
	}
}

// close drops every mapping: the node is closing, and no read uses them.
func (sm *spaceMaps) close() { sm.sweep(func(store.Registration) bool { return false }) }

// sweepSpaces sweeps the node's space mappings every spaceSweep until ctx
// ends.
func (n *Node) sweepSpaces(ctx context.Context) {
	t := time.NewTicker(spaceSweep)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			n.descs.sweep(n.st.Live)
			n.spaces.sweep(n.st.Live)
		}
	}
}

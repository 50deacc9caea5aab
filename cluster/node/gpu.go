package node

import (
	"fmt"
	"runtime"
	"sync"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/store"
)

// GPU objects cross nodes through pinned host memory (the staging path of
// docs/cluster.md, "GPU objects"): UCX builds without CUDA memory support
// cannot read GPU memory, and the CRC-32C of every chunk is computed where
// the bytes are in host memory anyway.
//
//   - seal: the object is copied device→host into a pinned buffer and its
//     chunks' checksums are computed there;
//   - expose: the object is copied device→host into a pinned buffer
//     registered with UCX once (kept with the buffer), which peers GET from;
//   - pull: chunks land in a pinned buffer of the reader, are checked, and
//     each is copied host→device into the replica as soon as it is checked
//     (cluster.LandingReplica), overlapping the wire.
//
// Pinned buffers are pooled (pinnedPool): allocating and registering
// gigabytes of pinned memory costs more than copying them, and a name
// published every training step needs the same sizes again and again.

// DefaultPinnedIdle bounds the bytes of idle pinned buffers a node keeps
// for the next GPU object's staging.
const DefaultPinnedIdle = 32 << 30

// pinnedUnit rounds pinned buffers up, so that objects of nearby sizes
// (the versions of one name) share buffers.
const pinnedUnit = 64 << 20

// pinned is one pinned host buffer of the pool, registered with UCX the
// first time it is exposed.
type pinned struct {
	hb  *cudaipc.HostBuffer
	dev *cudaipc.Device
	reg *ucxtransport.Region
}

func (b *pinned) size() int64 { return int64(len(b.hb.Bytes())) }

func (b *pinned) free() {
	if b.reg != nil {
		b.reg.Close()
	}
	b.hb.Free()
}

// pinnedPool keeps idle pinned buffers, the most recently returned last.
type pinnedPool struct {
	mu        sync.Mutex
	idle      []*pinned
	idleBytes int64
	max       int64
	closed    bool
}

// get returns a pinned buffer of at least size bytes of dev's context: the
// smallest idle one that fits, or a new one.
func (pp *pinnedPool) get(dev *cudaipc.Device, size int64) (*pinned, error) {
	pp.mu.Lock()
	best := -1
	for i, b := range pp.idle {
		if b.dev == dev && b.size() >= size && (best < 0 || b.size() < pp.idle[best].size()) {
			best = i
		}
	}
	if best >= 0 {
		b := pp.idle[best]
		pp.idle = append(pp.idle[:best], pp.idle[best+1:]...)
		pp.idleBytes -= b.size()
		pp.mu.Unlock()
		return b, nil
	}
	pp.mu.Unlock()
	n := (size + pinnedUnit - 1) / pinnedUnit * pinnedUnit
	hb, err := dev.AllocHost(n)
	if err != nil && n > size {
		hb, err = dev.AllocHost(size)
	}
	if err != nil {
		return nil, fmt.Errorf("pinned host memory for staging %d bytes: %w", size, err)
	}
	return &pinned{hb: hb, dev: dev}, nil
}

// put returns b to the pool, freeing the oldest idle buffers beyond max.
func (pp *pinnedPool) put(b *pinned) {
	pp.mu.Lock()
	if pp.closed {
		pp.mu.Unlock()
		b.free()
		return
	}
	pp.idle = append(pp.idle, b)
	pp.idleBytes += b.size()
	var drop []*pinned
	for pp.idleBytes > pp.max && len(pp.idle) > 0 {
		drop = append(drop, pp.idle[0])
		pp.idleBytes -= pp.idle[0].size()
		pp.idle = pp.idle[1:]
	}
	pp.mu.Unlock()
	for _, d := range drop {
		d.free()
	}
}

// close frees the idle buffers; buffers in use are freed when put back.
func (pp *pinnedPool) close() {
	pp.mu.Lock()
	idle := pp.idle
	pp.idle, pp.idleBytes, pp.closed = nil, 0, true
	pp.mu.Unlock()
	for _, b := range idle {
		b.free()
	}
}

// stageOut copies the GPU object of f into a pinned buffer of the pool.
func (n *Node) stageOut(f *store.ClusterFile) (*pinned, error) {
	b, err := n.pinned.get(f.GPU.Device, f.Size)
	if err != nil {
		return nil, err
	}
	if err := f.GPU.Device.CopyFromDevice(b.hb.Bytes()[:f.Size], f.GPU.Ptr); err != nil {
		n.pinned.put(b)
		return nil, fmt.Errorf("stage a GPU object device→host: %w", err)
	}
	return b, nil
}

// gpuChecksums computes the chunk checksums of the GPU object of f in host
// memory, on every CPU at once.
func (n *Node) gpuChecksums(f *store.ClusterFile, chunk int64) ([]uint32, error) {
	b, err := n.stageOut(f)
	if err != nil {
		return nil, err
	}
	defer n.pinned.put(b)
	return parallelChecksums(b.hb.Bytes()[:f.Size], chunk), nil
}

// parallelChecksums is cluster.Checksums spread over the CPUs.
func parallelChecksums(mem []byte, chunk int64) []uint32 {
	chunks := int((int64(len(mem)) + chunk - 1) / chunk)
	sums := make([]uint32, chunks)
	workers := min(runtime.GOMAXPROCS(0), chunks)
	if workers <= 1 {
		return cluster.Checksums(mem, chunk)
	}
	per := (chunks + workers - 1) / workers
	var wg sync.WaitGroup
	for w := range workers {
		lo, hi := w*per, min((w+1)*per, chunks)
		if lo >= hi {
			break
		}
		wg.Go(func() {
			start := int64(lo) * chunk
			end := min(int64(hi)*chunk, int64(len(mem)))
			copy(sums[lo:hi], cluster.Checksums(mem[start:end], chunk))
		})
	}
	wg.Wait()
	return sums
}

// exposeGPU says where peers read the GPU object of f: where UCX
// registers GPU memory, in its arena, registered once while any of its
// objects is exposed; elsewhere in a pinned buffer registered with UCX,
// which it stages the object into. release ends the exposure (and gives
// the buffer back). f itself is left to the caller.
func (n *Node) exposeGPU(f *store.ClusterFile) (cluster.Exposure, func(), error) {
	if n.tr.CanRegisterCUDA() {
		return n.exposeDeviceArena(f)
	}
	b, err := n.stageOut(f)
	if err != nil {
		return cluster.Exposure{}, nil, err
	}
	if b.reg == nil {
		if b.reg, err = n.tr.Register(b.hb.Bytes()); err != nil {
			n.pinned.put(b)
			return cluster.Exposure{}, nil, fmt.Errorf("register a pinned staging buffer with UCX: %w", err)
		}
	}
	e := cluster.Exposure{Worker: n.tr.WorkerAddress(), RKey: b.reg.Key(), Addr: b.reg.Addr(0), Size: f.Size}
	n.exposures.Add(1)
	n.exposedBytes.Add(uint64(f.Size))
	n.stagedBytes.Add(uint64(f.Size))
	return e, func() { n.pinned.put(b) }, nil
}

// exposeDeviceArena registers f's GPU arena with UCX directly (once while
// any of its objects is exposed), as exposeArena does a host arena.
func (n *Node) exposeDeviceArena(f *store.ClusterFile) (cluster.Exposure, func(), error) {
	n.mu.Lock()
	a := n.arenas[f.ArenaID]
	if a == nil {
		base := uint64(f.GPU.Ptr) - uint64(f.Offset)
		reg, err := n.tr.RegisterDevice(base, uint64(f.ArenaSize))
		if err != nil {
			n.mu.Unlock()
			return cluster.Exposure{}, nil, fmt.Errorf("register GPU arena %d with UCX: %w", f.ArenaID, err)
		}
		a = &arenaReg{reg: reg}
		n.arenas[f.ArenaID] = a
	}
	a.refs++
	n.mu.Unlock()
	e := cluster.Exposure{Worker: n.tr.WorkerAddress(), RKey: a.reg.Key(), Addr: a.reg.Addr(f.Offset), Size: f.Size}
	n.exposures.Add(1)
	n.exposedBytes.Add(uint64(f.Size))
	return e, func() {
		n.mu.Lock()
		if a.refs--; a.refs == 0 {
			a.reg.Close()
			delete(n.arenas, f.ArenaID)
		}
		n.mu.Unlock()
	}, nil
}

// gpuReplica is a replica in GPU memory being pulled: chunks land in a
// pinned buffer and each goes host→device once checked.
type gpuReplica struct {
	n      *Node
	f      *store.ClusterFile
	o      cluster.Object
	b      *pinned
	mu     sync.Mutex
	sealed bool
	done   bool
}

func (s sink) createGPU(f *store.ClusterFile, o cluster.Object) (cluster.Replica, error) {
	b, err := s.n.pinned.get(f.GPU.Device, f.Size)
	if err != nil {
		f.Release()
		return nil, fmt.Errorf("node %s: replica of %s: %w", s.n.cfg.Directory.Node, o.Ref(), err)
	}
	return &gpuReplica{n: s.n, f: f, o: o, b: b}, nil
}

func (r *gpuReplica) Bytes() []byte { return r.b.hb.Bytes()[:r.o.Size] }

// Landed implements cluster.LandingReplica: the checked chunk at off goes
// to the replica's GPU memory.
func (r *gpuReplica) Landed(off int64, b []byte) error {
	if err := r.f.GPU.Device.CopyToDevice(r.f.GPU.Ptr+cudaipc.DevicePtr(off), b); err != nil {
		return fmt.Errorf("node %s: copy a chunk of %s host→device: %w", r.n.cfg.Directory.Node, r.o.Ref(), err)
	}
	r.n.stagedBytes.Add(uint64(len(b)))
	return nil
}

func (r *gpuReplica) Seal() error {
	err := r.f.Seal()
	r.mu.Lock()
	r.sealed = err == nil
	r.mu.Unlock()
	r.end()
	return err
}

func (r *gpuReplica) Abort() {
	r.end()
	r.mu.Lock()
	sealed := r.sealed
	r.mu.Unlock()
	if sealed {
		r.n.st.DropCluster(r.o.Owner, r.o.Name, r.o.ID)
	}
}

// end gives the pinned buffer back and ends the replica's store session
// (once).
func (r *gpuReplica) end() {
	r.mu.Lock()
	done := r.done
	r.done = true
	r.mu.Unlock()
	if done {
		return
	}
	r.n.pinned.put(r.b)
	r.f.Release()
}

var _ cluster.LandingReplica = (*gpuReplica)(nil)

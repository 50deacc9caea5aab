package node

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/staging"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/store"
)

// GPU objects cross nodes through pinned host memory where UCX cannot read
// GPU memory (docs/cluster.md, "GPU objects"): the seal checksums the object
// on its GPU, publishes the record and stages it into a pinned buffer behind
// it (filling.go); an exposure lends peers a pinned buffer that holds it
// (the pool keeps buffers tagged with their incarnation); a pull lands
// chunks in a pinned buffer and copies and checks each on the reader's GPU
// (cluster.ReplicaTraits.LandSum). Pinned buffers are pooled (pinnedPool):
// allocating gigabytes of pinned memory costs more than copying them.

// DefaultPinnedIdle bounds the bytes of idle pinned buffers a node keeps
// for the next GPU object's staging.
const DefaultPinnedIdle = 32 << 30

// pinnedUnit rounds pinned buffers up, so that objects of nearby sizes
// (the versions of one name) share buffers.
const pinnedUnit = 64 << 20

// pinned is one pinned host buffer of the pool, registered with UCX the
// first time it is exposed.
type pinned struct {
	mem     []byte
	release func() error // frees mem
	dev     *cudaipc.Device
	reg     *ucxtransport.Region
	// tag is the cluster incarnation whose bytes the buffer holds ("" for
	// none): a GPU object's bytes never change after its seal, so a buffer
	// staged once (at the seal, or by an exposure, or the landing of a
	// pull) serves every later exposure of that incarnation without
	// copying it out again.
	tag string
}

func (b *pinned) size() int64 { return int64(len(b.mem)) }

func (b *pinned) free() {
	if b.reg != nil {
		b.reg.Close()
	}
	_ = b.release()
}

// pinnedPool keeps idle pinned buffers, the most recently returned last.
type pinnedPool struct {
	mu        sync.Mutex
	idle      []*pinned
	idleBytes int64
	max       int64
	closed    bool
	// alloc allocates n bytes of pinned memory of dev's context; nil means
	// staging.AllocPinned.
	alloc func(dev *cudaipc.Device, n int64) (mem []byte, release func() error, err error)
	// allocs and allocNanos count the buffers allocated and the time
	// their allocation took.
	allocs, allocNanos atomic.Int64
}

// take returns an idle buffer of dev holding incarnation tag's size bytes,
// or nil.
func (pp *pinnedPool) take(tag string, dev *cudaipc.Device, size int64) *pinned {
	if tag == "" {
		return nil
	}
	pp.mu.Lock()
	defer pp.mu.Unlock()
	for i := len(pp.idle) - 1; i >= 0; i-- {
		if b := pp.idle[i]; b.tag == tag && b.dev == dev && b.size() >= size {
			pp.removeLocked(i)
			return b
		}
	}
	return nil
}

func (pp *pinnedPool) removeLocked(i int) {
	pp.idleBytes -= pp.idle[i].size()
	pp.idle = append(pp.idle[:i], pp.idle[i+1:]...)
}

// get returns a pinned buffer of at least size bytes of dev's context,
// untagged: the smallest idle one that fits, an untagged one before one
// holding some incarnation's bytes, or a new one.
func (pp *pinnedPool) get(dev *cudaipc.Device, size int64) (*pinned, error) {
	pp.mu.Lock()
	best := -1
	better := func(b, than *pinned) bool {
		if (b.tag == "") != (than.tag == "") {
			return b.tag == ""
		}
		return b.size() < than.size()
	}
	for i, b := range pp.idle {
		if b.dev == dev && b.size() >= size && (best < 0 || better(b, pp.idle[best])) {
			best = i
		}
	}
	if best >= 0 {
		b := pp.idle[best]
		pp.removeLocked(best)
		pp.mu.Unlock()
		b.tag = ""
		return b, nil
	}
	pp.mu.Unlock()
	alloc := pp.alloc
	if alloc == nil {
		alloc = staging.AllocPinned
	}
	start := time.Now()
	n := (size + pinnedUnit - 1) / pinnedUnit * pinnedUnit
	mem, release, err := alloc(dev, n)
	if err != nil && n > size {
		mem, release, err = alloc(dev, size)
	}
	if err != nil {
		return nil, fmt.Errorf("pinned host memory for staging %d bytes: %w", size, err)
	}
	pp.allocs.Add(1)
	pp.allocNanos.Add(int64(time.Since(start)))
	return &pinned{mem: mem, release: release, dev: dev}, nil
}

// put returns b to the pool, with its tag, freeing the oldest idle buffers
// beyond max.
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
		pp.removeLocked(0)
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

// stageOut returns a pinned buffer holding the GPU object of f, of
// incarnation id: one staged before, or the object copied device→host
// into a buffer of the pool now.
func (n *Node) stageOut(f *store.ClusterFile, id string) (*pinned, error) {
	if b := n.pinned.take(id, f.GPU.Device, f.Size); b != nil {
		return b, nil
	}
	b, err := n.pinned.get(f.GPU.Device, f.Size)
	if err != nil {
		return nil, err
	}
	if err := f.GPU.Device.CopyFromDevice(b.mem[:f.Size], f.GPU.Ptr); err != nil {
		n.pinned.put(b)
		return nil, fmt.Errorf("stage a GPU object device→host: %w", err)
	}
	n.stagedBytes.Add(uint64(f.Size))
	return b, nil
}

// gpuSealTimes is where a GPU object's seal spent its time: staging it
// (the device→host copy and the checksums, a pinned buffer's allocation
// among them, alloc) and publishing its record.
type gpuSealTimes struct{ stage, alloc, publish time.Duration }

// deviceSums reports whether this node checksums GPU objects of dev on
// the device (cudaipc.Device.ChunkCRC32C) rather than on the host: unless
// Config.HostChecksums, where the driver runs the kernel (a device that
// cannot is logged once).
func (n *Node) deviceSums(dev *cudaipc.Device) bool {
	if n.hostSums.Load() {
		return false
	}
	if err := dev.CRC32CSupported(); err != nil {
		if _, logged := n.noDeviceSums.LoadOrStore(dev, true); !logged {
			n.log.Warn("GPU objects' chunk checksums run on the host: the device cannot compute them", "device", dev.String(), "err", err)
		}
		return false
	}
	return true
}

// gpuChecksums copies the GPU object of f device→host into a pinned
// buffer and returns its chunk checksums and the buffer holding the
// object, for the caller to tag (once published) and give back. The
// device computes the checksums while the bytes copy (deviceSums; the
// host computes them after the copy if the device fails at it), or else
// the host computes each slice's while the next one copies.
func (n *Node) gpuChecksums(ctx context.Context, f *store.ClusterFile, chunk int64) ([]uint32, *pinned, error) {
	dev, src := f.GPU.Device, f.GPU.Ptr
	copyOut := func(off int64, p []byte) error { return dev.CopyFromDevice(p, src+cudaipc.DevicePtr(off)) }
	if !n.deviceSums(dev) {
		sums, b, err := stageSums(ctx, &n.pinned, dev, f.Size, chunk, copyOut)
		if err != nil {
			return nil, nil, err
		}
		n.stagedBytes.Add(uint64(f.Size))
		n.hostSummed.Add(uint64(f.Size))
		return sums, b, nil
	}
	b, err := n.pinned.get(dev, f.Size)
	if err != nil {
		return nil, nil, err
	}
	var sums []uint32
	var sumErr error
	summed := make(chan struct{})
	go func() {
		defer close(summed)
		sums, sumErr = dev.ChunkCRC32C(src, f.Size, chunk)
	}()
	err = staging.CopyOutOnly(ctx, b.mem[:f.Size], 0, copyOut)
	<-summed
	if err != nil {
		n.pinned.put(b)
		return nil, nil, fmt.Errorf("stage a GPU object device→host: %w", err)
	}
	n.stagedBytes.Add(uint64(f.Size))
	if sumErr != nil {
		n.log.Warn("the device failed to checksum a GPU object: the host checksums its staged copy", "device", dev.String(), "err", sumErr)
		sums = cluster.ChecksumsParallel(b.mem[:f.Size], chunk)
		n.hostSummed.Add(uint64(f.Size))
	} else {
		n.deviceSummed.Add(uint64(f.Size))
	}
	return sums, b, nil
}

// stageSums fills a pinned buffer of pp with size bytes through copyOut
// (staging.CopyOut) and returns their chunk checksums and the buffer; on
// an error the buffer goes back to pp.
func stageSums(ctx context.Context, pp *pinnedPool, dev *cudaipc.Device, size, chunk int64, copyOut func(off int64, p []byte) error) ([]uint32, *pinned, error) {
	b, err := pp.get(dev, size)
	if err != nil {
		return nil, nil, err
	}
	sums, err := staging.CopyOut(ctx, b.mem[:size], chunk, staging.DefaultSealSlice, 0, copyOut)
	if err != nil {
		pp.put(b)
		return nil, nil, fmt.Errorf("stage a GPU object device→host: %w", err)
	}
	return sums, b, nil
}

// exposeGPU says where peers read the GPU object of f, of incarnation
// id: where UCX registers GPU memory, in its arena, registered once while
// any of its objects is exposed; elsewhere in a pinned buffer registered
// with UCX holding the object (staged before, or now). release ends the
// exposure (and gives the buffer back, still holding the object). f itself
// is left to the caller.
func (n *Node) exposeGPU(f *store.ClusterFile, id string) (cluster.Exposure, func(), error) {
	if n.tr.CanRegisterCUDA() {
		return n.exposeDeviceArena(f)
	}
	if fl := n.fillingFor(id); fl != nil {
		return n.exposeFilling(fl) // published before staged: staging now
	}
	b, err := n.stageOut(f, id)
	if err != nil {
		return cluster.Exposure{}, nil, err
	}
	if err := n.registerPinned(b); err != nil {
		n.pinned.put(b)
		return cluster.Exposure{}, nil, err
	}
	key, closeWindow, err := b.reg.Window(0, f.Size)
	if err != nil {
		n.pinned.put(b)
		return cluster.Exposure{}, nil, err
	}
	e := cluster.Exposure{Worker: n.tr.WorkerAddress(), RKey: key, Addr: b.reg.Addr(0), Size: f.Size}
	n.exposures.Add(1)
	n.exposedBytes.Add(uint64(f.Size))
	return e, func() {
		closeWindow()
		b.tag = id
		n.pinned.put(b)
	}, nil
}

// registerPinned registers b with UCX, once for the buffer's life.
func (n *Node) registerPinned(b *pinned) error {
	if b.reg != nil {
		return nil
	}
	start := time.Now()
	reg, err := n.tr.Register(b.mem)
	if err != nil {
		return fmt.Errorf("register a pinned staging buffer with UCX: %w", err)
	}
	b.reg = reg
	n.registerNanos.Add(int64(time.Since(start)))
	return nil
}

// exposeDeviceArena registers f's GPU arena with UCX directly (once while
// any of its objects is exposed), as exposeArena does a host arena.
func (n *Node) exposeDeviceArena(f *store.ClusterFile) (cluster.Exposure, func(), error) {
	return n.exposeRegistered(f, func() (*arenaReg, error) {
		base := uint64(f.GPU.Ptr) - uint64(f.Offset)
		reg, err := n.tr.RegisterDevice(base, uint64(f.ArenaSize))
		if err != nil {
			return nil, fmt.Errorf("register GPU arena %d with UCX: %w", f.ArenaID, err)
		}
		return &arenaReg{reg: reg}, nil
	})
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
	// exposed counts exposures of b to peers not yet released (Expose,
	// fanout.go): b goes back to the pool with the last of them.
	exposed int
	// sums: the device checksums each chunk once landed (LandedSum).
	sums bool
}

func (s sink) createGPU(f *store.ClusterFile, o cluster.Object) (cluster.Replica, error) {
	b, err := s.n.pinned.get(f.GPU.Device, f.Size)
	if err != nil {
		f.Release()
		return nil, fmt.Errorf("node %s: replica of %s: %w", s.n.cfg.Directory.Node, o.Ref(), err)
	}
	sums := s.n.deviceSums(f.GPU.Device) && f.GPU.Ptr%16 == 0
	return &gpuReplica{n: s.n, f: f, o: o, b: b, sums: sums}, nil
}

func (r *gpuReplica) Bytes() []byte { return r.b.mem[:r.o.Size] }

// Landed is ReplicaTraits.Land: the checked chunk at off goes to the
// replica's GPU memory (the host checked it: the puller calls LandedSum
// instead where the device checks).
func (r *gpuReplica) Landed(off int64, b []byte) error {
	if err := r.land(off, b); err != nil {
		return err
	}
	r.n.hostSummed.Add(uint64(len(b)))
	return nil
}

func (r *gpuReplica) land(off int64, b []byte) error {
	if err := r.f.GPU.Device.CopyToDevice(r.f.GPU.Ptr+cudaipc.DevicePtr(off), b); err != nil {
		return fmt.Errorf("node %s: copy a chunk of %s host→device: %w", r.n.cfg.Directory.Node, r.o.Ref(), err)
	}
	r.n.stagedBytes.Add(uint64(len(b)))
	return nil
}

// LandedSum is ReplicaTraits.LandSum (where the device runs the kernel
// and the replica is 16-byte aligned: sums): the chunk at off goes to
// the replica's GPU memory, and the device computes its CRC-32C there, on
// a stream of the kernel's own (cudaipc.Device.CopyToDeviceCRC32C): the
// pull's landings overlap rather than queue on the legacy default stream.
func (r *gpuReplica) LandedSum(off int64, b []byte) (uint32, error) {
	n := int64(len(b))
	sums, err := r.f.GPU.Device.CopyToDeviceCRC32C(r.f.GPU.Ptr+cudaipc.DevicePtr(off), b, (n+255)/256*256)
	if err == nil && len(sums) != 1 {
		err = fmt.Errorf("%d sums for one chunk of %d bytes", len(sums), n)
	}
	if err != nil {
		return 0, fmt.Errorf("node %s: copy a chunk of %s host→device and checksum it on %s: %w", r.n.cfg.Directory.Node, r.o.Ref(), r.f.GPU.Device, err)
	}
	r.n.stagedBytes.Add(uint64(n))
	r.n.deviceSummed.Add(uint64(n))
	return sums[0], nil
}

func (r *gpuReplica) Seal() error {
	err := r.f.Seal()
	r.mu.Lock()
	r.sealed = err == nil
	if r.sealed {
		r.b.tag = r.o.ID // every chunk landed checked: the buffer holds the replica
	}
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
		r.n.st.Drop(r.o.Owner, r.o.Name, r.o.ID)
	}
}

// end gives the pinned buffer back (or leaves that to the release of its
// last exposure to peers) and ends the replica's store session (once).
func (r *gpuReplica) end() {
	r.mu.Lock()
	done := r.done
	r.done = true
	exposed := r.exposed > 0
	r.mu.Unlock()
	if done {
		return
	}
	if !exposed {
		r.n.pinned.put(r.b)
	}
	r.f.Release()
}

// Traits implements cluster.Replica: a GPU replica's Bytes are its pinned
// landing buffer, each chunk landed (and, where the device can, checksummed
// there), and peers may read that buffer while it is pulled.
func (r *gpuReplica) Traits() cluster.ReplicaTraits {
	t := cluster.ReplicaTraits{Land: r.Landed, Expose: r.Expose}
	if r.sums {
		t.LandSum = r.LandedSum
	}
	return t
}

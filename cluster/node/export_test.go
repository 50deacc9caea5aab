package node

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/staging"
)

// PinsHeld is how many readers' pins the node holds replicas for.
func PinsHeld(n *Node) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.pins)
}

// StagedBytes is how many bytes of GPU objects the node copied through
// pinned host memory: device→host (at seals and exposures that found no
// copy staged before) and host→device (chunks landed by pulls).
func StagedBytes(n *Node) uint64 { return n.stagedBytes.Load() }

// PauseWatch holds the node's watch before it handles its next event,
// until resume is called.
func PauseWatch(n *Node) (resume func()) {
	n.watchMu.Lock()
	return n.watchMu.Unlock
}

// WatchHandled counts the events the node's watch has handled.
func WatchHandled(n *Node) uint64 { return n.watched.Load() }

// HoldDeleted makes n's Deleted hook wait until release is called (or the
// test ends).
func HoldDeleted(t testing.TB, n *Node) (release func()) {
	ch := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(ch) }) }
	f := func() { <-ch }
	n.beforeDelete.Store(&f)
	t.Cleanup(release)
	return release
}

// WithdrawWaits counts n's publishes that waited for its stale claim on
// their name to go.
func WithdrawWaits(n *Node) uint64 { return n.withdrawWaits.Load() }

// LastGPUSeal is where n's last GPU seal spent its time: staging (the
// copy and the checksums), of which allocating a pinned buffer, and
// publishing the record. ok is false before the first.
func LastGPUSeal(n *Node) (stage, alloc, publish time.Duration, ok bool) {
	t := n.lastGPUSeal.Load()
	if t == nil {
		return 0, 0, 0, false
	}
	return t.stage, t.alloc, t.publish, true
}

// PinnedAllocs is how many pinned buffers n allocated, and the time it
// took.
func PinnedAllocs(n *Node) (int64, time.Duration) {
	return n.pinned.allocs.Load(), time.Duration(n.pinned.allocNanos.Load())
}

// RegisterTime is the time n took to register pinned buffers with UCX.
func RegisterTime(n *Node) time.Duration { return time.Duration(n.registerNanos.Load()) }

// ReplicaCreateTime is the time n's store took to make GPU replicas.
func ReplicaCreateTime(n *Node) time.Duration { return time.Duration(n.replicaNanos.Load()) }

// UseAllocHost makes n's pinned buffers come from cuMemAllocHost instead
// of staging.AllocPinned; call it before n stages anything.
func UseAllocHost(n *Node) {
	n.pinned.alloc = func(dev *cudaipc.Device, size int64) ([]byte, func() error, error) {
		hb, err := dev.AllocHost(size)
		if err != nil {
			return nil, nil, err
		}
		return hb.Bytes(), hb.Free, nil
	}
}

// HoldPinnedAllocs makes n's allocations of pinned buffers of at least
// min bytes block for good (the process is to be killed), closing the
// returned channel when the first one starts: a GPU seal that needs a new
// staging buffer stops there, in the middle of its staging, before any
// record is written. Call it before the seal.
func HoldPinnedAllocs(n *Node, min int64) <-chan struct{} {
	reached := make(chan struct{})
	var once sync.Once
	n.pinned.mu.Lock()
	defer n.pinned.mu.Unlock()
	n.pinned.alloc = func(dev *cudaipc.Device, size int64) ([]byte, func() error, error) {
		if size >= min {
			once.Do(func() { close(reached) })
			select {}
		}
		return staging.AllocPinned(dev, size)
	}
	return reached
}

// SlowPulls delays every chunk n's pulls read by delay, so that a test can
// act in the middle of a pull, and returns the count of bytes those reads
// have delivered. Call it before n pulls anything.
func SlowPulls(n *Node, delay time.Duration) *atomic.Uint64 {
	var got atomic.Uint64
	n.p.Transport = slowTransport{n.p.Transport, delay, &got}
	return &got
}

// SetChunkTimeout sets n's pulls' chunk timeout (cluster.Puller's). Call
// it before n pulls anything.
func SetChunkTimeout(n *Node, d time.Duration) { n.p.ChunkTimeout = d }

type slowTransport struct {
	cluster.Transport
	delay time.Duration
	got   *atomic.Uint64
}

func (t slowTransport) Connect(ctx context.Context, addr []byte) (cluster.Endpoint, error) {
	ep, err := t.Transport.Connect(ctx, addr)
	if err != nil {
		return nil, err
	}
	return slowEndpoint{ep, t}, nil
}

type slowEndpoint struct {
	cluster.Endpoint
	t slowTransport
}

func (e slowEndpoint) Get(ctx context.Context, rkey []byte, addr uint64, dst []byte) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(e.t.delay):
	}
	if err := e.Endpoint.Get(ctx, rkey, addr, dst); err != nil {
		return err
	}
	e.t.got.Add(uint64(len(dst)))
	return nil
}

// GPUChecksummed is how many bytes of GPU objects had their chunk
// checksums computed by the device and by the host.
func GPUChecksummed(n *Node) (device, host uint64) { return n.deviceSummed.Load(), n.hostSummed.Load() }

// SetHostChecksums switches Config.HostChecksums.
func SetHostChecksums(n *Node, on bool) { n.hostSums.Store(on) }

// HookStaging runs hook before each slice a GPU object published before
// it is staged copies out (nil: none).
func HookStaging(n *Node, hook func(off int64) error) {
	if hook == nil {
		n.stageHook.Store(nil)
		return
	}
	n.stageHook.Store(&hook)
}

// Filling is how many GPU objects are being staged behind their records.
func Filling(n *Node) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.filling)
}

// FetchesDeferred is how many peers' fetches waited for bytes being staged.
func FetchesDeferred(n *Node) uint64 { return n.tr.Served().Deferred }

// FetchesRefused is how many peers' fetches the node refused.
func FetchesRefused(n *Node) uint64 { return n.tr.Served().Refused }

// WaitingGets is how many gets wait on n's directory for their name.
func WaitingGets(n *Node) int64 { return n.waitingGets.Load() }

// ControlAddr is the address the node's control channel is reached at.
func ControlAddr(n *Node) string { return n.cfg.Advertise }

// SpacesMapped counts the registrations whose memory the node keeps
// mapped for reads of KV spaces across nodes.
func SpacesMapped(n *Node) int {
	n.spaces.mu.Lock()
	defer n.spaces.mu.Unlock()
	return len(n.spaces.m)
}

// SetSpaceMode makes n's reads of KV spaces across nodes go "direct" (a
// Get a copy), "staged" (gathered at the source), or by their copies'
// size ("auto").
func SetSpaceMode(n *Node, mode string) {
	n.spaceMode.Store(map[string]int32{"auto": spaceModeAuto, "direct": spaceModeDirect, "staged": spaceModeStaged}[mode])
}

// KVStagedBytes counts the bytes n gathered for staged reads of its spaces.
func KVStagedBytes(n *Node) uint64 { return n.kvStagedBytes.Load() }

// SetMaxStaged bounds the staging of a group of layers of a staged read
// (on both sides: every node of the test process) until the test ends.
func SetMaxStaged(t testing.TB, n int64) {
	old := maxStaged
	maxStaged = n
	t.Cleanup(func() { maxStaged = old })
}

// OnPoolGet makes n call f(owner) each time a node owning keys of a get
// answered it, before the blocks are fetched; nil stops it.
func OnPoolGet(n *Node, f func(owner string)) {
	if f == nil {
		n.poolGetHook.Store(nil)
		return
	}
	n.poolGetHook.Store(&f)
}

// SetMaxPoolCallBytes sets the most bytes of blocks one call of a
// cluster-wide pool carries, until the test ends.
func SetMaxPoolCallBytes(t testing.TB, n int64) {
	old := maxPoolCallBytes
	maxPoolCallBytes = n
	t.Cleanup(func() { maxPoolCallBytes = old })
}

// GatherSpaceOnce has n read one small staged read of block block of the
// one-region space desc (on another node, for uid reader) with the
// control channel's "kvread": daemon to daemon, no client.
func GatherSpaceOnce(ctx context.Context, n *Node, reader uint32, desc []byte, node string, block int, size int64) ([]byte, error) {
	return n.p.GatherSpace(ctx, cluster.SpaceRead{Node: node, Reader: reader, Desc: desc, Regions: []int{0}, Sizes: []int64{size},
		Stage: &cluster.SpaceStage{Blocks: []int{block}, First: 0, Count: 1}})
}

// SourceGather is what n, the space's node, does for one "kvread" of
// block block of the one-region space desc, without the control channel.
func SourceGather(n *Node, reader uint32, desc []byte, block int, max int64) ([]byte, error) {
	return source{n}.GatherSpace(reader, desc, []int{0}, &cluster.SpaceStage{Blocks: []int{block}, First: 0, Count: 1}, max, nil)
}

// KVBatches is how many batches of small KV reads ("kvreads") n's
// control server answered.
func KVBatches(n *Node) uint64 { return n.cs.Stats().KVBatches }

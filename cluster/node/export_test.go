package node

import (
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
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

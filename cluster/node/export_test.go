package node

import (
	"sync"
	"testing"
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

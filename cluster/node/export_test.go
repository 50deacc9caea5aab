package node

// PinsHeld is how many readers' pins the node holds replicas for.
func PinsHeld(n *Node) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.pins)
}

// StagedBytes is how many bytes of GPU objects went through pinned host
// memory on the node.
func StagedBytes(n *Node) uint64 { return n.stagedBytes.Load() }

package node

// Exposures is how many replicas the node has exposed to peers.
func Exposures(n *Node) uint64 { return n.exposures.Load() }

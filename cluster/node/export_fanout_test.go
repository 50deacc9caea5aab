package node

import (
	"context"

	"github.com/cudaipc/cudaipc/cluster"
)

// Exposures is how many replicas the node has exposed to peers.
func Exposures(n *Node) uint64 { return n.exposures.Load() }

// CreateReplica makes a replica of o in n's store, as a pull does.
func CreateReplica(ctx context.Context, n *Node, o cluster.Object) (cluster.Replica, error) {
	return sink{n}.Create(ctx, o)
}

// ReadExposure reads len(dst) bytes of e through n's transport, as a
// peer's pull does.
func ReadExposure(ctx context.Context, n *Node, e cluster.Exposure, dst []byte) error {
	ep, err := n.tr.Connect(ctx, e.Worker)
	if err != nil {
		return err
	}
	defer ep.Close()
	return ep.Get(ctx, e.RKey, e.Addr, dst)
}

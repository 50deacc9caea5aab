package clustertest

import "github.com/cudaipc/cudaipc/cluster"

// EnableFanout makes n's pulls fan out (cluster.Puller.Feeds): call it
// before n pulls anything.
func (n *Node) EnableFanout() {
	n.P.Feeds, n.P.Feeding = n.Dir, n.Feeding
}

// Traits implements cluster.Replica: peers may read the replica while it
// is pulled.
func (r *replica) Traits() cluster.ReplicaTraits { return cluster.ReplicaTraits{Expose: r.Expose} }

// Expose is ReplicaTraits.Expose: the replica's bytes, filled or not,
// registered for peers' reads.
func (r *replica) Expose() (cluster.Exposure, func(), error) {
	rkey, addr, release, err := r.s.T.Register(r.o.b)
	if err != nil {
		return cluster.Exposure{}, nil, err
	}
	r.s.mu.Lock()
	r.s.exposed++
	r.s.mu.Unlock()
	return cluster.Exposure{Worker: r.s.T.WorkerAddress(), RKey: rkey, Addr: addr, Size: int64(len(r.o.b))}, func() {
		release()
		r.s.mu.Lock()
		r.s.exposed--
		r.s.mu.Unlock()
	}, nil
}

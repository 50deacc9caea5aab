package node

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Collectors returns the node's metrics: bytes pulled (whole replicas
// and partial ones) and exposed, pulls (by result) and in flight,
// failovers. The daemon registers them beside the store's.
func (n *Node) Collectors() []prometheus.Collector {
	return []prometheus.Collector{
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_pulled_bytes_total",
			Help: "Bytes of replicas pulled from other nodes and checked."},
			func() float64 { return float64(n.p.Stats().Bytes) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_partial_bytes_total",
			Help: "Bytes partial replicas read from other nodes (the chunks the tensors of a get's subset touch)."},
			func() float64 { return float64(n.p.Stats().PartialBytes) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_pulls_total",
			Help: "Pulls finished, successful or not.", ConstLabels: prometheus.Labels{"result": "ok"}},
			func() float64 { return float64(n.p.Stats().Pulls) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_pulls_total",
			Help: "Pulls finished, successful or not.", ConstLabels: prometheus.Labels{"result": "failed"}},
			func() float64 { return float64(n.p.Stats().Failed) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "cudaipc_cluster_pulls_in_flight",
			Help: "Pulls under way."},
			func() float64 { return float64(n.p.Stats().InFlight) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_failovers_total",
			Help: "Holders dropped mid-pull whose remaining chunks went to other holders."},
			func() float64 { return float64(n.p.Stats().Failovers) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_exposures_total",
			Help: "Replicas exposed to authenticated peers for reading."},
			func() float64 { return float64(n.exposures.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_exposed_bytes_total",
			Help: "Bytes of the replicas exposed to peers (what they may read; the reads themselves are one-sided)."},
			func() float64 { return float64(n.exposedBytes.Load()) }),
	}
}

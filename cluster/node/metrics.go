package node

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// Collectors returns the node's metrics: bytes pulled (whole replicas
// and partial ones) and exposed, pulls (by result) and in flight, gets
// waiting for the cluster, records written back, failovers, reads of
// peers (fetch or get), the answers to peers' fetches, and the control
// port's connections and refusals. The daemon registers them beside the
// store's.
func (n *Node) Collectors() []prometheus.Collector {
	cs := []prometheus.Collector{
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
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "cudaipc_cluster_waiting_gets",
			Help: "Gets waiting for the cluster to have their name (any node's create, or the directory back after an outage)."},
			func() float64 { return float64(n.waitingGets.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_records_rewritten_total",
			Help: "Records of this node written back to the directory after someone deleted or changed them without the cluster secret."},
			func() float64 { return float64(n.dir.Rewrites()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_failovers_total",
			Help: "Holders dropped mid-pull whose remaining chunks went to other holders."},
			func() float64 { return float64(n.p.Stats().Failovers) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_gpu_checksummed_bytes_total",
			Help: "Bytes of GPU objects whose chunk checksums were computed (at their seal here, or as a pull landed them), by where.", ConstLabels: prometheus.Labels{"where": "device"}},
			func() float64 { return float64(n.deviceSummed.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_gpu_checksummed_bytes_total",
			Help: "Bytes of GPU objects whose chunk checksums were computed (at their seal here, or as a pull landed them), by where.", ConstLabels: prometheus.Labels{"where": "host"}},
			func() float64 { return float64(n.hostSummed.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_exposures_total",
			Help: "Replicas exposed to authenticated peers for reading."},
			func() float64 { return float64(n.exposures.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_exposed_bytes_total",
			Help: "Bytes of the replicas exposed to peers (what they may read through the exposure's window)."},
			func() float64 { return float64(n.exposedBytes.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_reads_total",
			Help: "Reads of other nodes' memory, by how they were made.", ConstLabels: prometheus.Labels{"read": "fetch"}},
			func() float64 { f, _ := n.tr.Reads(); return float64(f) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_reads_total",
			Help: "Reads of other nodes' memory, by how they were made.", ConstLabels: prometheus.Labels{"read": "get"}},
			func() float64 { _, g := n.tr.Reads(); return float64(g) }),
	}
	for _, res := range []string{"ok", "failed"} {
		cs = append(cs, prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_kv_reads_total",
			Help:        "Reads of KV spaces of other nodes (kv_read) this node made for its clients, finished, by result.",
			ConstLabels: prometheus.Labels{"result": res}},
			func() float64 {
				if res == "ok" {
					return float64(n.kvReads.Load())
				}
				return float64(n.kvReadsFailed.Load())
			}))
	}
	cs = append(cs,
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_kv_read_bytes_total",
			Help: "Bytes of KV blocks read from other nodes' spaces into this node's clients' spaces."},
			func() float64 { return float64(n.kvReadBytes.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_kv_staged_bytes_total",
			Help: "Bytes of this node's KV spaces gathered for other nodes' staged reads."},
			func() float64 { return float64(n.kvStagedBytes.Load()) }))
	for _, st := range []string{"pending", "channel"} {
		cs = append(cs, prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "cudaipc_cluster_control_connections",
			Help:        "Connections to the control port: not yet authenticated (pending, bounded per source and in all) and authenticated channels.",
			ConstLabels: prometheus.Labels{"state": st}},
			func() float64 {
				s := n.cs.Stats()
				if st == "pending" {
					return float64(s.Pending)
				}
				return float64(s.Channels)
			}))
	}
	for _, reason := range cluster.RefusalReasons {
		cs = append(cs, prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_control_refused_total",
			Help:        "Connections the control port refused, by reason: closed, timeout, malformed, auth (no proof of the secret), source-limit, pending-limit, channel-limit.",
			ConstLabels: prometheus.Labels{"reason": reason}},
			func() float64 { return float64(n.cs.Stats().Refused[reason]) }))
	}
	for _, a := range []struct {
		result string
		v      func(ucx.FetchStats) uint64
	}{
		{"sent", func(s ucx.FetchStats) uint64 { return s.Sent }},
		{"refused", func(s ucx.FetchStats) uint64 { return s.Refused }},
		{"dropped", func(s ucx.FetchStats) uint64 { return s.Dropped }},
	} {
		cs = append(cs, prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_fetch_answers_total",
			Help:        "Peers' fetch requests this node answered: with the bytes, with a refusal (no open window of the token, or bytes outside it), or not at all (malformed, or the reader unreachable).",
			ConstLabels: prometheus.Labels{"result": a.result}},
			func() float64 { return float64(a.v(n.tr.Served())) }))
	}
	cs = append(cs, prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_fetch_deferred_total",
		Help: "Peers' fetches that waited for bytes still being staged (a GPU object published before its device→host copy ended)."},
		func() float64 { return float64(n.tr.Served().Deferred) }))
	return append(cs, prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "cudaipc_cluster_fetch_sent_bytes_total",
		Help: "Bytes this node sent answering peers' fetches."},
		func() float64 { return float64(n.tr.Served().SentBytes) }))
}

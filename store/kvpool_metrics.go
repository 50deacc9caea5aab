package store

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// poolMetrics are the metrics of KV block pools, by device (a pool's
// tier), never by pool name: names are the users' and unbounded. Gauges
// are read at scrape time; counters count as things happen, so that a
// deleted pool takes nothing back from them.
type poolMetrics struct {
	s *Store

	pools, blocks, bytes, capacity *prometheus.Desc

	hits, misses                          *prometheus.CounterVec // device, op (lookup or get)
	stored, evictions, putBytes, getBytes *prometheus.CounterVec // device
	remote                                *prometheus.CounterVec // op, result: cluster-wide pools' requests to other nodes
	lookupSeconds                         prometheus.Histogram
}

const poolPrefix = metricPrefix + "kv_pool_"

func newPoolMetrics(s *Store) *poolMetrics {
	dev := []string{"device"}
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: poolPrefix + name, Help: help}, append(dev, labels...))
	}
	return &poolMetrics{
		s: s,
		pools: prometheus.NewDesc(metricPrefix+"kv_pools",
			"KV block pools, by device.", dev, nil),
		blocks: prometheus.NewDesc(poolPrefix+"blocks",
			"Blocks of KV block pools, by device and state (ready: readable; writing: being put; pinned: by lookups and gets, part of ready).",
			[]string{"device", "state"}, nil),
		bytes: prometheus.NewDesc(poolPrefix+"bytes",
			"Bytes of the readable blocks of KV block pools, by device.", dev, nil),
		capacity: prometheus.NewDesc(poolPrefix+"capacity_bytes",
			"Bytes of memory KV block pools hold (their capacity, charged to their owners' quotas), by device.", dev, nil),
		hits:      counter("hits_total", "Keys found by lookups (the present prefix) and gets, by device and op.", "op"),
		misses:    counter("misses_total", "Keys not found by lookups (after the present prefix) and gets, by device and op.", "op"),
		stored:    counter("stored_total", "Blocks stored by puts, by device."),
		evictions: counter("evictions_total", "Blocks evicted from KV block pools to make room or by evict requests, by device."),
		putBytes:  counter("put_bytes_total", "Bytes of blocks stored by puts, by device."),
		getBytes:  counter("get_bytes_total", "Bytes of blocks handed to gets, by device."),
		remote: prometheus.NewCounterVec(prometheus.CounterOpts{Name: poolPrefix + "remote_requests_total",
			Help: "Requests of cluster-wide KV block pools this node sent the nodes owning their keys, by op and result (ok; absent: the node has no such pool; unavailable: it did not answer)."},
			[]string{"op", "result"}),
		lookupSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    poolPrefix + "lookup_seconds",
			Help:    "Time the daemon takes to answer a lookup, from its decoded request to its answer.",
			Buckets: prometheus.ExponentialBuckets(5e-6, 2.5, 12), // 5 µs to about 300 ms
		}),
	}
}

func (m *poolMetrics) register(reg prometheus.Registerer) error {
	return errors.Join(reg.Register(m), reg.Register(m.hits), reg.Register(m.misses), reg.Register(m.stored),
		reg.Register(m.evictions), reg.Register(m.putBytes), reg.Register(m.getBytes), reg.Register(m.remote), reg.Register(m.lookupSeconds))
}

// putDone counts a put's blocks stored in p and those it evicted.
func (m *poolMetrics) putDone(p *blockPool, stored, evicted int) {
	m.evictions.WithLabelValues(p.device).Add(float64(evicted))
	m.stored.WithLabelValues(p.device).Add(float64(stored))
	m.putBytes.WithLabelValues(p.device).Add(float64(int64(stored) * p.blockBytes))
}

// Describe implements prometheus.Collector.
func (m *poolMetrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{m.pools, m.blocks, m.bytes, m.capacity} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (m *poolMetrics) Collect(ch chan<- prometheus.Metric) {
	type sums struct{ pools, ready, writing, pinned, bytes, capacity float64 }
	byDev := map[string]*sums{}
	t := &m.s.pools
	t.mu.RLock()
	for _, p := range t.byName {
		d := byDev[p.device]
		if d == nil {
			d = &sums{}
			byDev[p.device] = d
		}
		p.mu.Lock()
		st := p.idx.Stats()
		p.mu.Unlock()
		d.pools++
		d.ready += float64(st.Ready)
		d.writing += float64(st.Writing)
		d.pinned += float64(st.Pinned)
		d.bytes += float64(int64(st.Ready) * p.blockBytes)
		d.capacity += float64(p.memSize)
	}
	t.mu.RUnlock()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	for dev, d := range byDev {
		gauge(m.pools, d.pools, dev)
		gauge(m.blocks, d.ready, dev, "ready")
		gauge(m.blocks, d.writing, dev, "writing")
		gauge(m.blocks, d.pinned, dev, "pinned")
		gauge(m.bytes, d.bytes, dev)
		gauge(m.capacity, d.capacity, dev)
	}
}

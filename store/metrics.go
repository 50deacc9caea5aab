package store

import (
	"errors"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the store's Prometheus metrics. Gauges of the store's state
// are read under the store's lock at scrape time, so they never drift from
// the state they describe; counters are incremented as things happen.
type metrics struct {
	s *Store

	objects       *prometheus.Desc
	bytesUsed     *prometheus.Desc
	bytesReserved *prometheus.Desc
	bytesCapacity *prometheus.Desc
	arenas        *prometheus.Desc
	bytesKept     *prometheus.Desc
	leases        *prometheus.Desc
	clients       *prometheus.Desc

	evictions *prometheus.CounterVec
	requests  *prometheus.CounterVec
	okByOp    sync.Map // op -> the requests counter of (op, "ok"): no label hashing per request
	rejected  *prometheus.CounterVec

	eventsDropped prometheus.Counter
	heldAfterFree prometheus.Gauge

	pools *poolMetrics // KV block pools (kvpool_metrics.go)
}

const metricPrefix = "cudaipc_store_"

func newMetrics(s *Store) *metrics {
	dev := []string{"device"}
	return &metrics{
		s: s,
		objects: prometheus.NewDesc(metricPrefix+"objects",
			"Objects in the store, by device and state (unsealed, sealed, or deleted but still leased).",
			[]string{"device", "state"}, nil),
		bytesUsed: prometheus.NewDesc(metricPrefix+"bytes_used",
			"Bytes taken by objects (sizes rounded up to the 256-byte alignment), by device.", dev, nil),
		bytesReserved: prometheus.NewDesc(metricPrefix+"bytes_reserved",
			"Bytes of the arenas objects are placed in, by device.", dev, nil),
		bytesCapacity: prometheus.NewDesc(metricPrefix+"bytes_capacity",
			"Most bytes the arenas of a device may take.", dev, nil),
		arenas: prometheus.NewDesc(metricPrefix+"arenas",
			"Arenas, by device.", dev, nil),
		bytesKept: prometheus.NewDesc(metricPrefix+"bytes_kept",
			"Bytes of empty GPU arenas kept for their owner's next objects (part of bytes_reserved), by device.", dev, nil),
		leases: prometheus.NewDesc(metricPrefix+"leases",
			"Live read leases.", nil, nil),
		clients: prometheus.NewDesc(metricPrefix+"clients",
			"Connected clients.", nil, nil),
		evictions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: metricPrefix + "evictions_total",
			Help: "Objects evicted to make room, by device.",
		}, dev),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: metricPrefix + "requests_total",
			Help: "Requests handled, by operation and result (ok or the error code in lower case).",
		}, []string{"op", "result"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: metricPrefix + "connections_rejected_total",
			Help: "Connections closed before or during the handshake, by reason.",
		}, []string{"reason"}),
		eventsDropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: metricPrefix + "events_dropped_total",
			Help: "Events not delivered because a subscriber's queue was full.",
		}),
		heldAfterFree: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: metricPrefix + "arenas_held_after_free",
			Help: "Empty GPU arenas given back to the allocator whose memory stays allocated until every client that mapped them unmaps them.",
		}),
		pools: newPoolMetrics(s),
	}
}

// request counts one request of op with result ("ok" or an error code in
// lower case).
func (m *metrics) request(op, result string) {
	if result != "ok" {
		m.requests.WithLabelValues(op, result).Inc()
		return
	}
	c, ok := m.okByOp.Load(op)
	if !ok {
		c, _ = m.okByOp.LoadOrStore(op, m.requests.WithLabelValues(op, "ok"))
	}
	c.(prometheus.Counter).Inc()
}

func (m *metrics) register(reg prometheus.Registerer) error {
	return errors.Join(reg.Register(m), reg.Register(m.evictions), reg.Register(m.requests), reg.Register(m.rejected), reg.Register(m.eventsDropped), reg.Register(m.heldAfterFree), m.pools.register(reg))
}

// Describe implements prometheus.Collector.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{m.objects, m.bytesUsed, m.bytesReserved, m.bytesCapacity, m.arenas, m.bytesKept, m.leases, m.clients} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	s := m.s
	s.mu.Lock()
	type counts struct{ unsealed, sealed, deleted int }
	byDev := make(map[*device]*counts, len(s.devices))
	for _, d := range s.devices {
		byDev[d] = &counts{deleted: d.deleted}
	}
	for _, e := range s.names {
		if !e.is(kindObject) {
			continue
		}
		if o := e.obj; o.sealed() {
			byDev[o.dev].sealed++
		} else {
			byDev[o.dev].unsealed++
		}
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	for d, c := range byDev {
		st := d.alloc.Stats()
		gauge(m.objects, float64(c.unsealed), d.name, "unsealed")
		gauge(m.objects, float64(c.sealed), d.name, "sealed")
		gauge(m.objects, float64(c.deleted), d.name, "deleted")
		gauge(m.bytesUsed, float64(st.Used), d.name)
		gauge(m.bytesReserved, float64(st.Reserved), d.name)
		gauge(m.bytesCapacity, float64(st.Capacity), d.name)
		gauge(m.arenas, float64(st.Arenas), d.name)
		gauge(m.bytesKept, float64(st.KeptBytes), d.name)
	}
	gauge(m.leases, float64(s.leases))
	gauge(m.clients, float64(len(s.sessions)))
	s.mu.Unlock()
}

package cudaipc_test

import (
	"slices"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// timer records each iteration so that benchmarks can report the median,
// which is steadier than the mean for driver calls with rare slow outliers.
type timer struct{ d []time.Duration }

func (tm *timer) time(f func()) {
	t0 := time.Now()
	f()
	tm.d = append(tm.d, time.Since(t0))
}

func (tm *timer) report(b *testing.B, name string) {
	if len(tm.d) == 0 {
		return
	}
	slices.Sort(tm.d)
	b.ReportMetric(float64(tm.d[len(tm.d)/2].Nanoseconds())/1e3, name+"-p50-µs")
	b.ReportMetric(float64(tm.d[len(tm.d)*99/100].Nanoseconds())/1e3, name+"-p99-µs")
}

func BenchmarkGetMemHandle(b *testing.B) {
	dev := testutil.RequireGPU(b)
	buf, err := dev.Alloc(1 << 20)
	if err != nil {
		b.Fatal(err)
	}
	defer buf.Free()
	var tm timer
	for b.Loop() {
		tm.time(func() {
			if _, err := buf.MemHandle(); err != nil {
				b.Fatal(err)
			}
		})
	}
	tm.report(b, "export")
}

func benchExporter(b *testing.B, size int64) (*cudaipc.Device, exportMsg) {
	dev := testutil.RequireGPU(b)
	_, m := startExporter(b, dev, size, 1)
	return dev, m
}

// benchOpenClose times an open of h and the close after it, each
// iteration.
func benchOpenClose(b *testing.B, dev *cudaipc.Device, h cudaipc.MemHandle) {
	var open, cl timer
	for b.Loop() {
		var p cudaipc.DevicePtr
		open.time(func() {
			var err error
			if p, err = dev.OpenMemHandle(h, cudaipc.LazyEnablePeerAccess); err != nil {
				b.Fatal(err)
			}
		})
		cl.time(func() {
			if err := dev.CloseMemHandle(p); err != nil {
				b.Fatal(err)
			}
		})
	}
	open.report(b, "open")
	cl.report(b, "close")
}

// BenchmarkOpenCloseCold opens and closes a 1 MiB allocation: every open
// maps it anew (docs/driver-facts.md, earlier: open p50 41 µs, close p50 30 µs).
func BenchmarkOpenCloseCold(b *testing.B) {
	dev, m := benchExporter(b, 1<<20)
	benchOpenClose(b, dev, m.Handle)
}

// BenchmarkOpenAlreadyOpen opens a handle that is already open in this
// process (docs/driver-facts.md, earlier: 2.6 µs open, 18 µs for the close that only decrements).
func BenchmarkOpenAlreadyOpen(b *testing.B) {
	dev, m := benchExporter(b, 1<<20)
	keep, err := dev.OpenMemHandle(m.Handle, cudaipc.LazyEnablePeerAccess)
	if err != nil {
		b.Fatal(err)
	}
	defer dev.CloseMemHandle(keep)
	benchOpenClose(b, dev, m.Handle)
}

// BenchmarkOpenEventHandle opens and closes an exported IPC event
// (docs/driver-facts.md, earlier: 455 µs). The first open in a process is reported on its own
// (first-open-µs): later opens of the same handle are far cheaper.
func BenchmarkOpenEventHandle(b *testing.B) {
	dev, m := benchExporter(b, 4096)
	var first timer
	first.time(func() {
		ev, err := dev.OpenEventHandle(m.EventHandle)
		if err != nil {
			b.Fatal(err)
		}
		if err := ev.Close(); err != nil {
			b.Fatal(err)
		}
	})
	var open timer
	for b.Loop() {
		var ev *cudaipc.Event
		open.time(func() {
			var err error
			if ev, err = dev.OpenEventHandle(m.EventHandle); err != nil {
				b.Fatal(err)
			}
		})
		if err := ev.Close(); err != nil {
			b.Fatal(err)
		}
	}
	open.report(b, "open")
	// After the loop: b.Loop's first call resets extra metrics.
	b.ReportMetric(float64(first.d[0].Nanoseconds())/1e3, "first-open-µs")
}

// BenchmarkImportCached imports and closes a region of an allocation that
// another Mapping keeps open: the cache answers without a driver call, to
// set against BenchmarkOpenCloseCold's open and close.
func BenchmarkImportCached(b *testing.B) {
	dev := testutil.RequireGPU(b)
	c := testutil.Spawn(b, "regionExporter", "SIZE=4194304", "SEED=1", "DEVICE="+dev.UUID().String())
	var msg regionMsg
	if err := c.Recv(&msg); err != nil || msg.Err != "" {
		b.Fatalf("exporter: %v %s", err, msg.Err)
	}
	keep, err := cudaipc.Import(msg.Region)
	if err != nil {
		b.Fatal(err)
	}
	defer keep.Close()
	sub, _ := msg.Region.Sub(4096, 4096)
	before := cudaipc.ImportCacheStats()
	var tm timer
	b.ReportAllocs()
	for b.Loop() {
		tm.time(func() {
			m, err := cudaipc.Import(sub)
			if err != nil {
				b.Fatal(err)
			}
			if err := m.Close(); err != nil {
				b.Fatal(err)
			}
		})
	}
	tm.report(b, "import+close")
	if d := cudaipc.ImportCacheStats().Opens - before.Opens; d != 0 {
		b.Fatalf("%d driver opens in the cached loop", d)
	}
}
